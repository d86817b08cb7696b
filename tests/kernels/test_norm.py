import pytest
import torch

from kernels import reference
from tests.kernels.helpers import poisoned_outputs, rel_err, tolerance

pytest.importorskip("triton")
from kernels.norm import add_rms_norm, rms_norm  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 16), (7, 40), (3, 5, 129)])
def test_rms_norm(device: torch.device, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, device=device) * 3
    weight = torch.randn(shape[-1], device=device)
    with poisoned_outputs():
        out = rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, reference.rms_norm(x, weight, 1e-5)) < 1e-3


@pytest.mark.parametrize("shape", [(1, 16), (7, 40), (3, 5, 129)])
def test_add_rms_norm(device: torch.device, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, device=device)
    residual = torch.randn(shape, device=device)
    weight = torch.randn(shape[-1], device=device)
    x_before, residual_before = x.clone(), residual.clone()
    with poisoned_outputs():
        out, summed = add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_summed = reference.add_rms_norm(x, residual, weight, 1e-6)
    assert rel_err(summed, ref_summed) < 1e-6
    assert rel_err(out, ref_out) < 1e-3
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_strided_rows(device: torch.device) -> None:
    x = torch.randn(6, 80, device=device)[:, :48]
    weight = torch.randn(48, device=device)
    with poisoned_outputs():
        out = rms_norm(x, weight, 1e-5)
    assert rel_err(out, reference.rms_norm(x, weight, 1e-5)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [4096, 8192, 5120])
def test_norms_gpu_bf16(hidden: int) -> None:
    x = torch.randn(4097, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    with poisoned_outputs():
        out = rms_norm(x, weight, 1e-5)
        fused, summed = add_rms_norm(x, residual, weight, 1e-5)
    assert rel_err(out, reference.rms_norm(x.float(), weight.float(), 1e-5)) < tolerance(torch.bfloat16)
    ref_fused, ref_summed = reference.add_rms_norm(x, residual, weight, 1e-5)
    assert rel_err(summed, ref_summed) < tolerance(torch.bfloat16)
    assert rel_err(fused, ref_fused.float()) < tolerance(torch.bfloat16)
