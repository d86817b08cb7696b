import importlib
import inspect
import pkgutil

import pytest
import torch

import kernels
from kernels import reference
from tests.kernels.helpers import random_paged_kv, rel_err, tolerance

OPS = ["add_rms_norm", "apply_token_bitmask_", "argmax", "decode_attention", "paged_attention", "rms_norm", "rotary_embedding", "rotary_kv_store",
       "silu_and_mul", "store_kv_cache"]


@pytest.mark.parametrize("name", OPS)
def test_signatures_match_the_reference(name: str) -> None:
    op, ref = getattr(kernels, name), getattr(reference, name)
    assert callable(op) and op is not ref
    assert inspect.signature(op).parameters.keys() == inspect.signature(ref).parameters.keys()


def test_triton_available_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_KERNELS", "reference")
    assert kernels.triton_available() is False
    monkeypatch.delenv("TOLLGATE_KERNELS")
    if not torch.cuda.is_available():
        assert kernels.triton_available() is False


def test_kernel_modules_do_not_shadow_the_ops() -> None:
    """Importing a module binds it in the package under its name: no module may be named like an op."""
    pytest.importorskip("triton")
    for module in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"kernels.{module.name}")
    assert kernels._triton_modules() is not None
    for name in kernels.__all__:
        assert getattr(kernels, name).__module__ == "kernels", name


def test_cpu_tensors_use_the_reference() -> None:
    x = torch.randn(3, 2, 8)
    weight = torch.randn(8)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    assert torch.equal(kernels.silu_and_mul(x), reference.silu_and_mul(x))
    kv = random_paged_kv([5, 20], 2, 8, 16, torch.float32, torch.device("cpu"))
    q = torch.randn(2, 4, 8)
    out = kernels.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.3)
    assert torch.equal(out, reference.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.3))


@pytest.mark.gpu
def test_cuda_tensors_use_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    kv = random_paged_kv([300, 4096], 8, 128, 16, torch.bfloat16, torch.device("cuda"))
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    ref = reference.decode_attention(*args, 0.1)
    decode, prefill = kernels.decode_attention(*args, 0.1), kernels.paged_attention(q, *args[1:], qsl, 0.1)
    assert rel_err(decode, ref.float()) < tolerance(torch.bfloat16)
    assert rel_err(prefill, ref.float()) < tolerance(torch.bfloat16)
    monkeypatch.setenv("TOLLGATE_KERNELS", "reference")
    assert torch.equal(kernels.decode_attention(*args, 0.1), ref)
