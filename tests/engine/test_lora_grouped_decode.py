"""Decode steps whose LoRA kernels take the grouped form (tokens sorted by adapter slot, each adapter's weights read
once a step) or the dense one (grouped shrinks, expands as GEMMs over every slot) give the logits and greedy tokens
of the per-token (BGMV) form, for a batch mixing adapters of several
ranks and targets with the base model. On CPU the engine's ops are the PyTorch references; here the LoRA ops run
their Triton kernels in Triton's interpreter (the rest of the model stays on the references), so the two engines
differ in their LoRA decode kernels only."""

import os
from collections import Counter

import pytest
import torch

import kernels
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.lora_helpers import save_base_and_mixed_adapters
from tests.engine.test_lora_peft_parity import _run

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the LoRA kernels in the interpreter"),
]



@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    return save_base_and_mixed_adapters(tmp_path_factory.mktemp("lora-grouped"))


@pytest.fixture
def interpreted_lora_kernels(monkeypatch):
    """kernels.lora_add_ and lora_add_silu_and_mul take their Triton path on CPU tensors; returns a count of the
    shrink kernels each decode form ran, and of the dense expand's rows."""
    pytest.importorskip("triton")
    modules = kernels._triton_modules()
    calls: Counter = Counter()
    for form in ("bgmv_shrink", "grouped_shrink", "sgmv_shrink"):
        kernel = getattr(modules.punica_shrink, form)
        monkeypatch.setattr(modules.punica_shrink, form,
                            lambda *a, _kernel=kernel, _form=form, **kw: calls.update([_form]) or _kernel(*a, **kw))
    dense_rows = modules.punica_dense.dense_rows
    monkeypatch.setattr(modules.punica_dense, "dense_rows",
                        lambda *a, **kw: calls.update(["dense_rows"]) or dense_rows(*a, **kw))
    triton_for = kernels._triton_for
    for name in ("lora_add_", "lora_add_silu_and_mul"):
        op = getattr(kernels, name)

        def on_triton(*args, _op=op, **kwargs):
            kernels._triton_for = lambda t: modules
            try:
                return _op(*args, **kwargs)
            finally:
                kernels._triton_for = triton_for

        monkeypatch.setattr(kernels, name, on_triton)
    return calls


def _engine(base_dir, adapters, decode_kernels):
    # four slots for three adapters: the grouped kernels' grid also spans a slot no token uses
    return LLMEngine(EngineConfig(model=base_dir, num_kv_blocks=64, max_loras=4, max_lora_rank=16,
                                  lora_modules=adapters, lora_decode_kernels=decode_kernels))


def test_grouped_and_dense_decode_kernels_give_the_per_token_kernels_logits_and_tokens(base_and_adapters,
                                                                                      interpreted_lora_kernels):
    base_dir, adapters = base_and_adapters
    gen = torch.Generator().manual_seed(8)
    prompt = lambda n: torch.randint(0, 300, (n,), generator=gen).tolist()  # noqa: E731
    shared = prompt(21)
    requests = {  # 6 adapter tokens over 3 adapters in each decode step, and a base-model row between them
        "all-a": (shared, "all-r16"), "base": (shared, None), "qv-a": (prompt(5), "qv-r8"),
        "all-b": (prompt(13), "all-r16"), "mlp": (prompt(9), "mlp-r4"), "qv-b": (shared, "qv-r8"),
        "all-c": (prompt(2), "all-r16"),
    }
    runs = {}
    for form in ("bgmv", "grouped", "dense"):
        interpreted_lora_kernels.clear()
        runs[form] = _run(_engine(base_dir, adapters, form), requests, max_tokens=4)
        decode_steps = 3  # the first token comes from the prefill
        # each decode step: one shrink per projection group (4) per layer (2), all of this run's form; the dense
        # form's shrinks are the grouped ones, and its o, gate|up and down projections (3) expand densely
        shrink = "bgmv" if form == "bgmv" else "grouped"
        expected = {f"{shrink}_shrink": decode_steps * 4 * 2, "sgmv_shrink": interpreted_lora_kernels["sgmv_shrink"]}
        if form == "dense":
            expected["dense_rows"] = decode_steps * 3 * 2
        assert dict(interpreted_lora_kernels) == expected
    bgmv_out, bgmv_logits = runs["bgmv"]
    for form in ("grouped", "dense"):
        form_out, form_logits = runs[form]
        for rid in requests:
            assert form_out[rid].outputs[0].token_ids == bgmv_out[rid].outputs[0].token_ids, (form, rid)
            assert len(form_logits[rid]) == 4
            for (n, got), (m, want) in zip(form_logits[rid], bgmv_logits[rid]):
                assert n == m
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    grouped_logits = runs["grouped"][1]
    # the adapters matter: the shared prompt's tokens or logits differ between the base model and an adapter
    assert not torch.allclose(grouped_logits["base"][1][1], grouped_logits["all-a"][1][1], atol=1e-3)
