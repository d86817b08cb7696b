"""Kernel tests run the Triton kernels on the GPU when there is one, else on the CPU through Triton's
interpreter. TRITON_INTERPRET must be set before triton is imported (triton.language's own helpers
are decorated at import), so it is set here, before the test modules import the kernels."""

import os
import sys

import pytest
import torch

INTERPRET_TOO_LATE = (
    not torch.cuda.is_available() and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
)
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> torch.device:
    """Where the small-shape tests run: CUDA when present, else the CPU through the interpreter."""
    if INTERPRET_TOO_LATE:
        pytest.fail("triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1; set it in the environment")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
