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
from kernels import pdl, reference  # noqa: E402


def test_pdl_is_off_for_cpu_tensors_and_the_interpreter(monkeypatch) -> None:
    assert pdl.launch_options(torch.zeros(1)) == {}
    if torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert pdl.launch_options(torch.zeros(1, device="cuda")) == {}


@pytest.mark.gpu
def test_pdl_follows_the_switch_and_the_device(monkeypatch) -> None:
    x = torch.zeros(1, device="cuda")
    monkeypatch.setenv("TOLLGATE_PDL", "0")
    assert pdl.launch_options(x) == {}
    monkeypatch.delenv("TOLLGATE_PDL")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.launch_options(x) == ({"PDL": True, "launch_pdl": True} if hopper else {})


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


def _replayed(x: torch.Tensor, layers, new_inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    _chain(x, layers, kernels)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, layers, kernels)
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
    monkeypatch.setenv("TOLLGATE_PDL", "1")
    with_pdl = _replayed(x, layers, inputs)
    monkeypatch.setenv("TOLLGATE_PDL", "0")
    serial = _replayed(x, layers, inputs)
    for a, b in zip(with_pdl, serial):
        assert torch.equal(a, b)
    # and the chain itself is right: the float32 references of the same ops
    float_layers = [{k: (v if v.dtype == torch.int8 else v.float()) for k, v in layer.items()} for layer in layers]
    ref = _chain(inputs[-1].float(), float_layers, REFERENCE_OPS)
    assert rel_err(with_pdl[-1], ref) < tolerance(torch.bfloat16)


REFERENCE_OPS = types.SimpleNamespace(add_rms_norm=reference.add_rms_norm, silu_and_mul=reference.silu_and_mul,
                                      int8_linear=reference.int8_linear, linear=F.linear)
