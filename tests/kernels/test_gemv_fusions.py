"""The decode GEMVs' fused RMSNorm before them and residual add after them (kernels/gemv_rows.py), in each kernel
(bf16 / fp8 through kernels/gemv.py, int8 through kernels/gemv_int.py, int4 through kernels/gemv_int4.py), against
rms_norm then dequantize-then-matmul in float32, plus the residual: random odd sizes, several rows, a residual
stream of large values (the norm's scale must come out of the fused sum of squares), the gated epilogue, bad
arguments; on the GPU at Llama-3-8B's shapes inside a CUDA graph."""

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from tests.kernels.helpers import poisoned_outputs, rel_err
from tests.kernels.test_quant_linear import random_int4

pytest.importorskip("triton")
from kernels.gemv import gemv  # noqa: E402
from kernels.gemv_int import gemv_int8  # noqa: E402
from kernels.gemv_int4 import gemv_int4  # noqa: E402
from kernels.quant_linear_config import GemvConfig  # noqa: E402

EPS = 1e-5
CONFIG = GemvConfig(block_n=4, block_k=64, num_warps=2)
KINDS = ["bf16", "fp8", "int8", "int4"]


def random_layer(kind: str, n: int, k: int, device: torch.device):
    """(run(x, **fusions), the dequantized float32 weight [N, K]) of a random layer of this kind."""
    if kind == "bf16":
        w = torch.randn(n, k, device=device).to(torch.bfloat16)
        return (lambda x, config=CONFIG, **f: gemv(x, w, config=config, **f)), w.float()
    if kind == "fp8":
        w = (torch.randn(n, k, device=device) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.rand(n, device=device) * 0.01
        return (lambda x, config=CONFIG, **f: gemv(x, w, scales, config=config, **f)), \
            reference.dequantize_int8(w, scales, torch.float32)
    if kind == "int8":
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device)
        scales = torch.rand(n, device=device) * 0.01
        return (lambda x, config=CONFIG, **f: gemv_int8(x, q, scales, config=config, **f)), \
            reference.dequantize_int8(q, scales, torch.float32)
    q, s, z = random_int4(n, k, 32, device)
    return (lambda x, config=CONFIG, **f: gemv_int4(x, q, s, z, 32, config=config, **f)), \
        reference.dequantize_int4(q, s, z, 32, torch.float32)


def residual_stream(m: int, k: int, device: torch.device) -> torch.Tensor:
    """Rows like a decoder's residual stream: values in the tens, one channel in the hundreds."""
    x = torch.randn(m, k, device=device) * 20
    x[:, 3] = 300.0
    return x.to(torch.bfloat16)


def normed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 36, 192), (3, 20, 256), (1, 37, 224)])
def test_fused_norm_matches_rms_norm_then_linear(device: torch.device, kind: str, m: int, n: int, k: int) -> None:
    run, w = random_layer(kind, n, k, device)
    x = residual_stream(m, k, device)
    norm_weight = (torch.rand(k, device=device) + 0.5).to(torch.bfloat16)
    with poisoned_outputs():
        out = run(x, norm=(norm_weight, EPS))
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    want = F.linear(normed(x, norm_weight), w)
    assert rel_err(out, want) < 8e-3
    # without the norm the same kernel is off by the rows' rms (tens): the scale is applied, not skipped
    assert rel_err(run(x), want) > 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_fused_residual_add(device: torch.device, kind: str) -> None:
    m, n, k = 2, 40, 128
    run, w = random_layer(kind, n, k, device)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    residual = residual_stream(m, n, device)
    with poisoned_outputs():
        out = run(x, residual=residual)
    assert rel_err(out, F.linear(x.float(), w) + residual.float()) < 8e-3
    # norm and residual together: the next layer's input projection after the previous one's add
    norm_weight = torch.rand(k, device=device).to(torch.bfloat16)
    both = run(x, norm=(norm_weight, EPS), residual=residual)
    assert rel_err(both, F.linear(normed(x, norm_weight), w) + residual.float()) < 8e-3


@pytest.mark.parametrize("kind", KINDS)
def test_fused_norm_in_the_gated_gemv(device: torch.device, kind: str) -> None:
    m, n, k = 2, 2 * 18, 128
    run, w = random_layer(kind, n, k, device)
    x = residual_stream(m, k, device)
    norm_weight = (torch.rand(k, device=device) + 0.5).to(torch.bfloat16)
    out = run(x, gated=True, norm=(norm_weight, EPS))
    assert out.shape == (m, n // 2)
    assert rel_err(out, reference.silu_and_mul(F.linear(normed(x, norm_weight), w))) < 2e-2


@pytest.mark.parametrize("kind", KINDS)
def test_fusions_reject_bad_arguments(device: torch.device, kind: str) -> None:
    run, _ = random_layer(kind, 8, 64, device)
    x = torch.randn(1, 64, device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="norm weight of shape"):
        run(x, norm=(torch.ones(32, device=device, dtype=torch.bfloat16), EPS))
    with pytest.raises(ValueError, match="residual"):
        run(x, residual=torch.zeros(1, 7, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual"):
        run(x, residual=torch.zeros(1, 8, device=device, dtype=torch.float32))
    with pytest.raises(ValueError, match="gated GEMV takes no residual"):
        run(x, gated=True, residual=torch.zeros(1, 4, device=device, dtype=torch.bfloat16))


LLAMA_8B = [(6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False)]


def op_for(kind: str, n: int, k: int, device: torch.device):
    """(the engine's op for one layer of this kind, as run(x, gated, **fusions), the float32 weight)."""
    import kernels

    if kind == "bf16":
        w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
        return (lambda x, gated, **f: (kernels.linear_silu_and_mul if gated else kernels.linear)(x, w, **f)), w.float()
    if kind in ("fp8", "int8"):
        from engine.quantization.fp8 import quantize_fp8
        from engine.quantization.int8 import quantize_int8

        q, scales = (quantize_fp8 if kind == "fp8" else quantize_int8)(torch.randn(n, k, device=device) * 0.02)
        return (lambda x, gated, **f: (kernels.int8_linear_silu_and_mul if gated else kernels.int8_linear)(
            x, q, scales, None, **f)), reference.dequantize_int8(q, scales, torch.float32)
    q, s, z = random_int4(n, k, 128, device)
    return (lambda x, gated, **f: kernels.int4_linear(x, q, s, z, 128, None, gated=gated, **f)), \
        reference.dequantize_int4(q, s, z, 128, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k", "gated"), LLAMA_8B)
def test_fused_ops_gpu_llama_shapes_in_graph(kind: str, n: int, k: int, gated: bool) -> None:
    """The engine's ops at Llama-3-8B's shapes with the shipped launch rules (kernels/gemv_configs.py; fp8's gated
    GEMV takes a separate norm kernel), captured in a CUDA graph with the norm and, where the layer is not gated,
    the residual, and replayed on new rows."""
    device = torch.device("cuda")
    run, w = op_for(kind, n, k, device)
    x = residual_stream(1, k, device)
    norm_weight = (torch.rand(k, device=device) + 0.5).to(torch.bfloat16)
    fusions = {"norm": (norm_weight, EPS)}
    if not gated:
        fusions["residual"] = residual_stream(1, n, device)
    run(x, gated, **fusions)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, gated, **fusions)
    x.copy_(residual_stream(1, k, device))
    graph.replay()
    want = F.linear(normed(x, norm_weight), w)
    want = reference.silu_and_mul(want) if gated else want + fusions["residual"].float()
    assert rel_err(out, want) < 1e-2
