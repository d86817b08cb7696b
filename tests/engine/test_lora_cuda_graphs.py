"""On the GPU: decode steps that use LoRA adapters replay CUDA graphs captured with the adapters' kernels, and give the
greedy tokens of the same engine run eagerly, also after an adapter is swapped into a slot between two generate calls
(the graphs read the slot pool's stacks, which a load copies into), with the per-token and with the grouped kernels.
float32, so that the graphs' and the eager steps' attention splits agree far beyond any near-tie."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.lora_helpers import save_base_and_mixed_adapters

pytestmark = pytest.mark.gpu

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    return save_base_and_mixed_adapters(tmp_path_factory.mktemp("lora-graphs"))


def _llm(base_dir: str, adapters: dict[str, str], eager: bool, decode_kernels: str = "auto") -> LLM:
    # two slots for three adapters: the second call's new adapter evicts one the first call used
    return LLM(base_dir, device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8, max_loras=2,
               max_lora_rank=16, lora_modules=adapters, enforce_eager=eager, lora_decode_kernels=decode_kernels)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=gen).tolist() for n in lengths]


def _tokens(llm: LLM, prompts: list[list[int]], loras: list[str | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_name=loras)]


def test_adapter_decode_steps_replay_graphs_and_equal_eager(base_and_adapters):
    base_dir, adapters = base_and_adapters
    graphed, eager = _llm(base_dir, adapters, eager=False), _llm(base_dir, adapters, eager=True)
    runner = graphed.engine.runner
    assert runner.lora_graphs is not None and runner.graphs is not None
    assert eager.engine.runner.lora_graphs is None
    shared = _prompts(1, (29,))[0]
    calls = [  # (prompts, adapters): each call's prompts are prefilled in one step, then decode together
        ([shared, shared, *_prompts(2, (5, 40, 17))], [None, "qv-r8", "all-r16", "qv-r8", None]),
        ([shared, shared, *_prompts(3, (12, 3, 33))], ["mlp-r4", None, "all-r16", "mlp-r4", "all-r16"]),
        ([shared], ["qv-r8"]),  # batch-1 decode: the one-row graphs, with qv-r8 loaded into a slot again
        ([shared, *_prompts(4, (9,))], [None, None]),  # base-only steps keep the graphs without adapters
    ]
    pool = graphed.engine.lora.pool
    for prompts, loras in calls:
        lora_replays, base_replays = runner.lora_graphs.num_replays, runner.graphs.num_replays
        got = _tokens(graphed, prompts, loras)
        assert got == _tokens(eager, prompts, loras), loras
        if any(loras):
            assert runner.lora_graphs.num_replays - lora_replays >= MAX_TOKENS - 1  # every decode step
            assert runner.graphs.num_replays == base_replays
        else:
            assert runner.lora_graphs.num_replays == lora_replays
            assert runner.graphs.num_replays - base_replays >= MAX_TOKENS - 1
        if loras[:2] == [None, "qv-r8"] or loras[:2] == ["mlp-r4", None]:
            assert got[0] != got[1]  # the adapter changes the tokens of the shared prompt
    # mlp-r4 went into the slot qv-r8 had, then qv-r8 into the one all-r16 had
    assert pool.num_loads == 4
    assert graphed.engine.kv.num_used_blocks == 0


def test_adapter_re_added_under_its_name_is_seen_by_the_graphs(base_and_adapters):
    """Replacing an adapter's weights (add_lora with the same name) loads them into a slot the captured graphs read."""
    base_dir, adapters = base_and_adapters
    graphed, eager = _llm(base_dir, adapters, eager=False), _llm(base_dir, adapters, eager=True)
    prompts = [_prompts(1, (29,))[0], _prompts(5, (6,))[0]]
    before = _tokens(graphed, prompts, ["qv-r8", "mlp-r4"])
    assert before == _tokens(eager, prompts, ["qv-r8", "mlp-r4"])
    for llm in (graphed, eager):
        llm.add_lora("qv-r8", adapters["all-r16"])
    replays = graphed.engine.runner.lora_graphs.num_replays
    after = _tokens(graphed, prompts, ["qv-r8", "mlp-r4"])
    assert graphed.engine.runner.lora_graphs.num_replays - replays >= MAX_TOKENS - 1
    assert after == _tokens(eager, prompts, ["qv-r8", "mlp-r4"])
    assert after[0] != before[0] and after[1] == before[1]
    assert after[0] == _tokens(graphed, prompts, ["all-r16", "mlp-r4"])[0]


@pytest.mark.parametrize("decode_kernels", ["grouped", "dense", "auto"])
def test_grouped_and_dense_lora_kernels_in_graphs_give_the_eager_tokens(base_and_adapters, decode_kernels):
    """Mixed batches whose decode steps replay graphs of the grouped or dense kernels (forced, or under "auto" while
    the batch has at least two tokens per adapter: dense while its adapters fill both slots, then grouped and
    per-token graphs as sequences finish) give the tokens of eager steps, grouped, dense and per token."""
    base_dir, adapters = base_and_adapters
    graphed = _llm(base_dir, adapters, eager=False, decode_kernels=decode_kernels)
    eager = {form: _llm(base_dir, adapters, eager=True, decode_kernels=form) for form in ("grouped", "dense", "bgmv")}
    shared = _prompts(1, (29,))[0]
    calls = [  # (prompts, adapters, max_tokens): sequences finishing one after another shrink the batch
        ([shared, shared, shared, *_prompts(6, (5, 40, 17, 8, 21))],
         ["qv-r8", None, "all-r16", "all-r16", "qv-r8", None, "all-r16", "qv-r8"], [24, 8, 24, 20, 16, 24, 4, 12]),
        ([shared, shared, *_prompts(7, (12, 3, 33))], ["mlp-r4", "all-r16", None, "mlp-r4", "all-r16"],
         [MAX_TOKENS] * 5),
        ([shared], ["all-r16"], [MAX_TOKENS]),
    ]
    for prompts, loras, lengths in calls:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, lora_name=loras)]
        for form, llm in eager.items():
            assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_name=loras)], form
    keys = set(graphed.engine.runner.lora_graphs.graphs)
    if decode_kernels == "auto":  # two adapters in the two slots: dense; batch 1 and the batches of one token per
        # adapter replay per-token graphs
        assert {"dense", "bgmv"} <= {form for _, _, form in keys}
        assert any(bs == 1 and form == "bgmv" for bs, _, form in keys)
        assert any(bs > 1 and form == "bgmv" for bs, _, form in keys)  # the batch of call 1 as it shrinks
    else:
        assert {form for _, _, form in keys} == {decode_kernels}
    assert graphed.engine.kv.num_used_blocks == 0
