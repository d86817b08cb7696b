import os

# One OpenMP thread per process (this one and the servers, Ray workers and engine cores it starts, which inherit
# it): the tests' shapes are small, and on a 2-core box a second thread spins waiting for the first at every op.
# The SmolLM2 greedy batch of tests/engine/test_smollm2.py took 4-5x the wall and CPU time with 2 threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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
