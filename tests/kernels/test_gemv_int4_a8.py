"""The int4 decode GEMV with int8 activations (kernels/gemv_int4_a8.py): its reference (kernels/reference.py
`int4_linear_a8`) against dequantize-then-matmul in float32, the checks that name a bad argument, and on the GPU the
kernel against that reference (the same int8 activations, so to float32 rounding) and against dequantize-then-matmul,
at random odd shapes and Llama-3-8B's, with every fusion, several rows and inside a CUDA graph."""

import logging

import pytest
import torch
import torch.nn.functional as F

from kernels import gemv_int4_a8, reference
from tests.kernels.helpers import poisoned_outputs, rel_err
from tests.kernels.test_gemv_fusions import EPS, normed, residual_stream
from tests.kernels.test_quant_linear import random_int4

LLAMA_8B = [(6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False)]


def test_activations_round_to_int8_per_run() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 256) * torch.rand(3, 256) * 40
    q, scales = reference.quantize_activations_int8(x, 32)
    runs = x.view(3, 8, 32)
    assert q.abs().max() <= 127 and torch.equal(q, q.round())
    assert torch.equal(q.view(3, 8, 32).abs().amax(-1), torch.full((3, 8), 127.0))  # each run's largest hits 127
    assert ((q.view(3, 8, 32) * scales.unsqueeze(-1) - runs).abs() <= scales.unsqueeze(-1) / 2 * 1.0001).all()
    zero_q, _ = reference.quantize_activations_int8(torch.zeros(1, 64), 16)
    assert torch.equal(zero_q, torch.zeros(1, 64))


@pytest.mark.parametrize("norm", [False, True])
def test_reference_is_close_to_dequantize_then_matmul(norm: bool) -> None:
    torch.manual_seed(1)
    n, k = 24, 384
    x = residual_stream(3, k, torch.device("cpu"))
    q, s, z = random_int4(n, k, 128, torch.device("cpu"))
    bias = torch.randn(n).to(torch.bfloat16)
    weight = reference.dequantize_int4(q, s, z, 128, torch.float32)
    norm_args = ((torch.rand(k) + 0.5).to(torch.bfloat16), EPS) if norm else None
    want = F.linear(normed(x, norm_args[0]) if norm else x.float(), weight, bias.float())
    got = reference.int4_linear_a8(x, q, s, z, 128, bias, norm=norm_args, run=32)
    assert got.shape == (3, n) and got.dtype == torch.float32
    assert rel_err(got, want) < 2e-2  # ~1.2% in runs of 32: the run holding channel 3 (300) rounds coarsely
    plain = torch.randn(3, k).to(torch.bfloat16)  # no outlier: ~0.5%
    assert rel_err(reference.int4_linear_a8(plain, q, s, z, 128, None, run=32), F.linear(plain.float(), weight)) < 1e-2


def test_bad_arguments_are_named() -> None:
    cpu = torch.device("cpu")
    q, s, z = random_int4(16, 256, 128, cpu)
    x = torch.randn(1, 256).to(torch.bfloat16)

    def reason(**changes) -> str:
        args = {"x": x, "qweight": q, "scales": s, "zeros": z, "group_size": 128, "bias": None, "gated": False,
                "norm": None, "residual": None} | changes
        return gemv_int4_a8.problem(**args) or ""

    assert gemv_int4_a8.problem(x, q, s, z, 128, None, False, None, None) is None
    assert reason(group_size=48).startswith("group_size")
    assert reason(scales=s.double()).startswith("scales")
    assert reason(zeros=z.int()).startswith("zeros")
    assert reason(x=x.float()).startswith("x:")
    assert reason(x=torch.randn(1, 128).to(torch.bfloat16)).startswith("x:")
    assert reason(qweight=q[:12], scales=s[:12], zeros=z[:12]).startswith("qweight")
    assert reason(bias=torch.zeros(15, dtype=torch.bfloat16)).startswith("bias")
    assert reason(norm=(torch.ones(255, dtype=torch.bfloat16), EPS)).startswith("norm")
    assert reason(residual=torch.zeros(1, 16, dtype=torch.bfloat16), gated=True).startswith("residual")
    assert reason(residual=torch.zeros(1, 8, dtype=torch.bfloat16)).startswith("residual")
    with pytest.raises(ValueError, match="gemv_int4_a8: group_size"):
        gemv_int4_a8.gemv_int4_a8(x, q, s, z, 48)
    with pytest.raises(ValueError, match="CUDA"):
        gemv_int4_a8.gemv_int4_a8(x, q, s, z, 128)
    assert not gemv_int4_a8.takes(x, q, s, z, 128)  # CPU tensors take the other paths


def test_int4_linear_asks_for_this_kernel_only_with_int8_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from kernels import int4_matmul

    assert gemv_int4_a8.available() == hasattr(torch.cuda, "_compile_kernel")
    asked = []
    monkeypatch.setattr(gemv_int4_a8, "takes", lambda *args: asked.append(args) or False)
    q, s, z = random_int4(16, 256, 128, torch.device("cpu"))
    x = torch.randn(1, 256)
    want = int4_matmul.int4_linear(x, q, s, z, 128, None, int8_activations=False)
    assert not asked
    assert torch.equal(int4_matmul.int4_linear(x, q, s, z, 128, None), want) and len(asked) == 1


@pytest.mark.gpu
def test_a_variant_nvrtc_refuses_leaves_the_call_to_the_half_precision_gemv(monkeypatch: pytest.MonkeyPatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    import kernels

    device = torch.device("cuda")
    q, s, z = random_int4(64, 256, 128, device)
    x = residual_stream(1, 256, device)

    def refuse(*args, **kwargs):
        raise RuntimeError("NVRTC refused")

    gemv_int4_a8._kernel.cache_clear()
    monkeypatch.setattr(torch.cuda, "_compile_kernel", refuse)
    try:
        with caplog.at_level(logging.WARNING, logger=gemv_int4_a8.__name__):
            assert not gemv_int4_a8.takes(x, q, s, z, 128)
            out = kernels.int4_linear(x, q, s, z, 128, None)
        assert "unavailable" in caplog.text
        with pytest.raises(RuntimeError, match="did not compile"):
            gemv_int4_a8.gemv_int4_a8(x, q, s, z, 128)
    finally:
        gemv_int4_a8._kernel.cache_clear()  # the real compiler's variants for the tests after this one
    assert rel_err(out, F.linear(x.float(), reference.dequantize_int4(q, s, z, 128, torch.float32))) < 1e-2


def expected(x, q, s, z, group_size, bias, gated, norm, residual) -> torch.Tensor:
    """The kernel's result from the reference: gate and up rounded to bf16 before the SiLU, as the kernel does."""
    out = reference.int4_linear_a8(x, q, s, z, group_size, bias, norm=norm, run=gemv_int4_a8.RUN)
    if gated:
        half = out.shape[-1] // 2
        gate, up = out[..., :half].bfloat16().float(), out[..., half:].bfloat16().float()
        return gate * torch.sigmoid(gate) * up
    return out + residual.float() if residual is not None else out


def assert_matches_reference(out: torch.Tensor, want: torch.Tensor) -> None:
    """Within the bf16 output's rounding (two units in the last place) plus the kernel's float32 sums of per-chunk
    terms that cancel (zero points up to 16 make each chunk's term ~10x the output): 0.1% of the largest output,
    a twentieth of what rounding the activations to int8 moves them."""
    bound = want.abs() * 2 ** -7 + want.abs().max() * 1e-3
    assert ((out.float() - want).abs() <= bound).all(), float(((out.float() - want).abs() - bound).max())


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k", "group_size"), [(1, 40, 256, 128), (3, 24, 384, 64), (2, 8, 2048, 32)])
@pytest.mark.parametrize("fusion", ["plain", "bias", "norm", "residual", "gated", "gated_norm_bias"])
@pytest.mark.parametrize("run", [8, 16, 32])
def test_kernel_matches_reference(m: int, n: int, k: int, group_size: int, fusion: str, run: int,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run length the kernel compiles for (activations sharing one scale), the shipped one included."""
    monkeypatch.setattr(gemv_int4_a8, "RUN", run)
    torch.manual_seed(2)
    device = torch.device("cuda")
    q, s, z = random_int4(n, k, group_size, device)
    x = residual_stream(m, k, device)
    gated = fusion.startswith("gated")
    bias = torch.randn(n, device=device).to(torch.bfloat16) if "bias" in fusion else None
    norm = ((torch.rand(k, device=device) + 0.5).to(torch.bfloat16), EPS) if "norm" in fusion else None
    residual = residual_stream(m, n, device) if fusion == "residual" else None
    assert gemv_int4_a8.takes(x, q, s, z, group_size, bias, gated, norm, residual)
    with poisoned_outputs():
        out = gemv_int4_a8.gemv_int4_a8(x, q, s, z, group_size, bias, gated=gated, norm=norm, residual=residual)
    assert out.shape == (m, n // 2 if gated else n) and out.dtype == torch.bfloat16
    assert_matches_reference(out, expected(x, q, s, z, group_size, bias, gated, norm, residual))
    if not gated:  # few silu(gate) * up outputs amplify the rounding too unevenly for a bound of their own
        x = torch.randn(m, k, device=device).to(torch.bfloat16)  # no outlier channel: ~0.5-1% off the exact product
        out = gemv_int4_a8.gemv_int4_a8(x, q, s, z, group_size, bias, norm=norm, residual=residual)
        weight = reference.dequantize_int4(q, s, z, group_size, torch.float32)
        exact = F.linear(normed(x, norm[0]) if norm else x.float(), weight, bias.float() if bias is not None else None)
        assert rel_err(out, exact + (residual.float() if residual is not None else 0)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k", "gated"), LLAMA_8B)
def test_llama_shapes_through_int4_linear_in_a_graph(n: int, k: int, gated: bool) -> None:
    """kernels.int4_linear at one row takes this kernel (with the norm, and the residual where not gated; gated, the
    norm runs as its own kernel first), captured in a CUDA graph and replayed on new rows; the half-precision GEMV
    agrees to the int8 rounding."""
    import kernels

    device = torch.device("cuda")
    q, s, z = random_int4(n, k, 128, device)
    x = residual_stream(1, k, device)
    norm = ((torch.rand(k, device=device) + 0.5).to(torch.bfloat16), EPS)
    residual = None if gated else residual_stream(1, n, device)
    assert gemv_int4_a8.takes(x, q, s, z, 128, None, gated, norm, residual)
    kernels.int4_linear(x, q, s, z, 128, None, gated=gated, norm=norm, residual=residual)  # compiles outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.int4_linear(x, q, s, z, 128, None, gated=gated, norm=norm, residual=residual)
    x.copy_(residual_stream(1, k, device))
    graph.replay()
    if gated:  # the gated projection takes the norm kernel's output (kernels/int4_matmul.py); silu(gate) * up
        # scales the float32 sums' error (~1e-3 of a run's terms) by the other factor, so compare as a whole
        want = expected(kernels.rms_norm(x, *norm), q, s, z, 128, None, gated, None, None)
        assert rel_err(out, want) < 5e-3
    else:
        assert_matches_reference(out, expected(x, q, s, z, 128, None, gated, norm, residual))
    from kernels.int4_matmul import int4_linear
    from kernels.gemv_configs import int4_gemv_config

    half = int4_linear(x, q, s, z, 128, None, gated=gated, norm=norm, residual=residual,
                       gemv=int4_gemv_config(n, k, gated, normed=True))
    assert rel_err(out, half) < 3e-2
