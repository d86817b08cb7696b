import pytest
import torch

from kernels import reference
from tests.kernels.helpers import poisoned_outputs, rel_err, tolerance

pytest.importorskip("triton")
from kernels.activation import silu_and_mul  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 2), (5, 74), (2, 3, 2 * 1500)])
def test_silu_and_mul(device: torch.device, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, device=device) * 4
    with poisoned_outputs():
        out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert rel_err(out, reference.silu_and_mul(x)) < 1e-3


def test_silu_and_mul_strided_rows(device: torch.device) -> None:
    x = torch.randn(4, 100, device=device)[:, :66]
    with poisoned_outputs():
        out = silu_and_mul(x)
    assert rel_err(out, reference.silu_and_mul(x)) < 1e-3


@pytest.mark.gpu
def test_silu_and_mul_gpu_bf16() -> None:
    x = torch.randn(1023, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    with poisoned_outputs():
        out = silu_and_mul(x)
    assert rel_err(out, reference.silu_and_mul(x.float())) < tolerance(torch.bfloat16)
