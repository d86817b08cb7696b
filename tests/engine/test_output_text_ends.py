"""How an output ends: a character the output stopped inside of is left out of its text, stray bytes before it are
not (engine/detokenizer.py finish), at max_tokens and at the end of sequence alike; the logprobs are those of the
tokens whose text the output keeps (no end of sequence, nothing past a stop string)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.helpers import write_tiny_model_with_smollm2_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [1, 10, 200, 33, 47, 300, 21, 99]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(write_tiny_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("ends")), device="cpu")


def token_of(llm: LLM, raw: bytes) -> int:
    return next(i for i in range(llm.tokenizer.vocab_size) if llm.tokenizer.token_bytes([i]) == raw)


@pytest.mark.parametrize("count", [1, 5, 40, 300])
def test_stray_bytes_at_max_tokens_stay_in_the_text(llm, count):
    """A lone 0x80 is no beginning of a character: each one is a U+FFFD of the text, the last ones too (all
    trailing ones were dropped: 300 gave 297 characters, 5 gave none)."""
    lone = token_of(llm, b"\x80")
    [out] = llm.generate([PROMPT], [SamplingParams(temperature=0, ignore_eos=True, max_tokens=count,
                                                   logit_bias={lone: 100.0})])
    assert out.outputs[0].token_ids == [lone] * count
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == "\ufffd" * count == llm.tokenizer.decode([lone] * count)


def test_a_character_cut_by_max_tokens_is_left_out_and_the_text_before_it_stays(llm):
    start = token_of(llm, b" \xe6")  # a space and the first byte of a three-byte character
    [out] = llm.generate([PROMPT], [SamplingParams(temperature=0, ignore_eos=True, max_tokens=1,
                                                   logit_bias={start: 100.0})])
    assert out.outputs[0].token_ids == [start] and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == " "


def test_stray_bytes_before_the_end_of_sequence_are_in_the_text(llm):
    """min_tokens holds the end of sequence back for three tokens; then it wins over the stray byte (20 more of bias than it). The bytes held
    back for a character that never came go out at the end (they were dropped at the end of sequence)."""
    lone = token_of(llm, b"\x80")
    eos = min(llm.engine.eos_token_ids)
    params = SamplingParams(temperature=0, min_tokens=3, max_tokens=10, logit_bias={lone: 80.0, eos: 100.0})
    [out] = llm.generate([PROMPT], [params])
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[:3] == [lone] * 3
    assert out.outputs[0].text == "\ufffd" * 3


@pytest.mark.parametrize("include_stop", [False, True])
def test_logprobs_are_those_of_the_tokens_whose_text_the_output_keeps(llm, include_stop):
    """A stop string cuts the text: the tokens that begin past the cut lose their logprobs; a token that holds the
    cut keeps its. Letters only (the single-letter tokens biased above every other, sampled with a seed: the same
    letters both times), so each prefix of tokens decodes to a prefix of the text."""
    letters = {i: 100.0 for i in range(llm.tokenizer.vocab_size)
               if len(raw := llm.tokenizer.token_bytes([i])) == 1 and raw.isalpha() and raw.islower()}
    assert len(letters) == 26
    [free] = llm.generate([PROMPT], [SamplingParams(temperature=1.0, seed=5, max_tokens=60, ignore_eos=True,
                                                    logit_bias=letters, logprobs=0)])
    ids, text = free.outputs[0].token_ids, free.outputs[0].text
    assert len(text) == len(ids) == 60 and text.isalpha()
    stop = text[15:18]
    at = text.index(stop)
    assert at >= 10  # seeded sampling: the letters vary, and the first place of the stop string is not the start
    cut = at + len(stop) if include_stop else at
    starts = [len(llm.tokenizer.decode(ids[:i])) for i in range(len(ids))]
    kept = sum(1 for start in starts if start < cut)
    [out] = llm.generate([PROMPT], [SamplingParams(temperature=1.0, seed=5, max_tokens=60, ignore_eos=True,
                                                   logit_bias=letters, logprobs=0, stop=[stop],
                                                   include_stop_str_in_output=include_stop)])
    assert out.outputs[0].text == text[:cut] and out.outputs[0].stop_reason == stop
    assert [lp.token_id for lp in out.outputs[0].logprobs] == ids[:kept]


def test_the_end_of_sequence_has_no_logprob(llm):
    eos = min(llm.engine.eos_token_ids)
    [out] = llm.generate([PROMPT], [SamplingParams(temperature=0, min_tokens=3, max_tokens=10, logprobs=2,
                                                   logit_bias={eos: 100.0})])
    ids = out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "stop" and ids[-1] == eos and len(ids) == 4
    assert [lp.token_id for lp in out.outputs[0].logprobs] == ids[:3]
