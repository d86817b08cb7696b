"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run, and on Hopper a chain of the decode
step's kernels launched with it gives bit for bit what the same chain gives launched the ordinary way, in CUDA-graph
replays where a read of unfinished output would show."""

import types

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import rel_err, tolerance

pytest.importorskip("triton")
import kernels  # noqa: E402
from kernels import cuda_launch, formats, pdl, reference  # noqa: E402


def test_pdl_is_off_for_cpu_tensors_and_the_interpreter(monkeypatch) -> None:
    assert pdl.launch_options(torch.zeros(1)) == {} == pdl.launch_options(torch.zeros(1), early=True)
    if torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert pdl.launch_options(torch.zeros(1, device="cuda")) == {}


@pytest.mark.gpu
def test_pdl_follows_the_device() -> None:
    x = torch.zeros(1, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.launch_options(x) == ({"PDL": True, "launch_pdl": True} if hopper else {})
    assert pdl.launch_options(x, early=True) == ({"PDL": True, "EARLY": True, "launch_pdl": True} if hopper else {})


def test_nvrtc_kernel_arguments_become_c_values() -> None:
    t = torch.zeros(4)
    assert cuda_launch._argument(t).value == t.data_ptr()
    assert cuda_launch._argument(4096).value == 4096 and cuda_launch._argument(1e-5).value == 1e-5
    for bad in (True, "x", None):
        with pytest.raises(TypeError, match="kernel arguments"):
            cuda_launch._argument(bad)


def _layers(hidden: int, inter: int, count: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)

    layers = []
    for _ in range(count):
        q = torch.randint(-127, 128, (2 * inter, hidden), device="cuda", dtype=torch.int8, generator=gen)
        layers.append({
            "norm": 1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen).to(torch.bfloat16),
            "up_q": q, "up_scales": torch.rand(2 * inter, device="cuda", generator=gen) / (127 * hidden**0.5),
            "down": weight(hidden, inter),
        })
    return layers


def _chain(x: torch.Tensor, layers: list[dict[str, torch.Tensor]], ops) -> torch.Tensor:
    """Residual MLP blocks as the decoder runs them at batch 1: add + RMSNorm, int8 gate_up GEMV, SiLU, bf16 down
    GEMV; each kernel reads what the one before it wrote."""
    residual = x
    h = x
    for layer in layers:
        normed, residual = ops.add_rms_norm(h, residual, layer["norm"], 1e-5)
        h = ops.linear(ops.silu_and_mul(ops.int8_linear(normed, layer["up_q"], layer["up_scales"], None)),
                       layer["down"])
    return ops.add_rms_norm(h, residual, layers[0]["norm"], 1e-5)[0]


def _replayed(x: torch.Tensor, layers, new_inputs: list[torch.Tensor], chain=_chain) -> list[torch.Tensor]:
    """chain(x, layers, kernels) captured in a CUDA graph, replayed once per new input copied into x."""
    chain(x, layers, kernels)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x, layers, kernels)
    results = []
    for new in new_inputs:
        x.copy_(new)
        graph.replay()
        results.append(out.clone())
    return results


@pytest.mark.gpu
def test_pdl_chain_in_a_graph_equals_serial_launches(monkeypatch) -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    layers = _layers(hidden=1024, inter=2816, count=16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = [torch.randn(1, 1024, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(20)]
    x = torch.empty(1, 1024, device="cuda", dtype=torch.bfloat16)
    with_pdl = _replayed(x, layers, inputs)
    monkeypatch.setattr(pdl, "enabled", lambda t: False)
    serial = _replayed(x, layers, inputs)
    for a, b in zip(with_pdl, serial):
        assert torch.equal(a, b)
    # and the chain itself is right: the float32 references of the same ops
    float_layers = [{k: (v if v.dtype == torch.int8 else v.float()) for k, v in layer.items()} for layer in layers]
    ref = _chain(inputs[-1].float(), float_layers, REFERENCE_OPS)
    assert rel_err(with_pdl[-1], ref) < tolerance(torch.bfloat16)


REFERENCE_OPS = types.SimpleNamespace(add_rms_norm=reference.add_rms_norm, silu_and_mul=reference.silu_and_mul,
                                      int8_linear=reference.int8_linear, linear=F.linear)


def _int4_layers(hidden: int, inter: int, count: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(2)

    def int4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randint(0, 16, (n, k), device="cuda", generator=gen)
        scales = (torch.rand(n, k // 128, device="cuda", generator=gen) + 0.5) / (8 * k**0.5)
        zeros = torch.randint(0, 16, (n, k // 128), device="cuda", dtype=torch.uint8, generator=gen)
        return formats.pack_int4(q), scales, zeros

    return [{"norm": 1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen).to(torch.bfloat16),
             "gate_up": int4(2 * inter, hidden), "down": int4(hidden, inter)} for _ in range(count)]


def _int4_chain(x: torch.Tensor, layers: list[dict], ops) -> torch.Tensor:
    """Residual MLP blocks as the int4 decoder runs them at batch 1: RMSNorm, the gated int4 gate_up GEMV, the int4
    down GEMV adding the residual (on CUDA the int8-activation GEMV, launched through kernels/cuda_launch.py)."""
    for layer in layers:
        h = ops.int4_linear(ops.rms_norm(x, layer["norm"], 1e-5), *layer["gate_up"], 128, None, gated=True)
        x = ops.int4_linear(h, *layer["down"], 128, None, residual=x)
    return x


@pytest.mark.gpu
def test_dependent_launches_of_the_int4_chain_in_a_graph_equal_serial_launches(monkeypatch) -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    layers = _int4_layers(hidden=1024, inter=2816, count=16)
    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = [torch.randn(1, 1024, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(20)]
    x = torch.empty(1, 1024, device="cuda", dtype=torch.bfloat16)
    with_pdl = _replayed(x, layers, inputs, _int4_chain)
    monkeypatch.setattr(pdl, "enabled", lambda t: False)
    serial = _replayed(x, layers, inputs, _int4_chain)
    for a, b in zip(with_pdl, serial):
        assert torch.equal(a, b)
    # Each layer rounds its activations to int8, so a last-place difference from the float64 reference flips an int8
    # value now and then and 16 layers spread it: 1.9-2.4% over these 20 inputs, ~2% on average.
    reference_ops = types.SimpleNamespace(rms_norm=reference.rms_norm, int4_linear=_reference_int4_a8)
    errors = [rel_err(out, _int4_chain(new, layers, reference_ops)) for out, new in zip(with_pdl, inputs)]
    assert max(errors) < 3e-2 and sum(errors) / len(errors) < 2.5e-2, errors


def _reference_int4_a8(x, qweight, scales, zeros, group_size, bias, *, gated=False, residual=None):
    out = reference.int4_linear_a8(x.to(torch.bfloat16), qweight, scales, zeros, group_size, bias)
    if residual is not None:
        out = out + residual.float()
    return (reference.silu_and_mul(out) if gated else out).to(torch.bfloat16)
