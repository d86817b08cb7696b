import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when it is first imported: without a GPU, kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def shared_data_dir():
    """../shared/data beside the checkout; tests that need a file skip when it is absent."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.abspath(os.path.join(here, "..", "..", "shared", "data"))
