"""xgrammar serves only the JSON schemas whose every keyword it enforces (engine/xgrammar_backend.py): for each
keyword on that list, a document jsonschema accepts is accepted token by token and one jsonschema refuses is not;
schemas with any other keyword go to llguidance; and a sequence whose xgrammar matcher is done or broken is masked to
end-of-sequence only."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from engine.config import SamplingParams
from engine.grammar import GrammarCompiler
from engine.sequence import Sequence
from engine.structured_outputs import StructuredOutputs
from engine.token_mask import TokenMasker
from engine.xgrammar_backend import ENFORCED_KEYWORDS, enforces
from tests.engine.helpers import smollm2_tokenizer

pytest.importorskip("xgrammar")

# (keyword, schema, a valid document, an invalid one): each document as json.dumps writes it
PROBES: list[tuple[str, dict[str, Any], Any, Any]] = [
    ("minimum/maximum (integer)", {"type": "integer", "minimum": 3, "maximum": 10}, 5, 11),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 3}, 4, 3),
    ("minimum/maximum (number)", {"type": "number", "minimum": 0, "maximum": 1}, 0.5, 1.5),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1}, 0.5, 1),
    ("minLength", {"type": "string", "minLength": 3}, "abc", "ab"),
    ("maxLength", {"type": "string", "maxLength": 3}, "abc", "abcd"),
    ("minItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1, 2], [1]),
    ("maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1, 2], [1, 2, 3]),
    ("items", {"type": "array", "items": {"type": "string"}}, ["a"], [1]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
     [1, "a"], [1, 2]),
    ("const", {"const": "x"}, "x", "y"),
    ("enum", {"enum": ["a", 1, None]}, None, "b"),
    ("type list", {"type": ["string", "null"]}, None, 1),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "a", True),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"a": 1}, {}),
    ("properties", {"type": "object", "properties": {"a": {"type": "integer"}}}, {"b": 2}, {"a": "x"}),
    ("additionalProperties: false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    ("additionalProperties: schema", {"type": "object", "additionalProperties": {"type": "integer"}}, {"b": 2},
     {"b": "x"}),
    ("$ref / $defs", {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}},
                      "required": ["a"]}, {"a": 1}, {"a": "x"}),
    ("definitions", {"definitions": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/definitions/n"}},
     [1], ["x"]),
    ("recursive $ref", {"$defs": {"t": {"type": "object", "properties": {"c": {"type": "array",
                                                                              "items": {"$ref": "#/$defs/t"}}},
                                        "required": ["c"], "additionalProperties": False}}, "$ref": "#/$defs/t"},
     {"c": [{"c": []}]}, {"c": [{}]}),
    ("minProperties", {"type": "object", "minProperties": 1}, {"a": 1}, {}),
    ("maxProperties", {"type": "object", "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
]


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    tokenizer = smollm2_tokenizer()
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def accepts(grammars: GrammarCompiler, schema: dict[str, Any], document: Any) -> bool:
    """Whether a new xgrammar matcher of the schema takes the document's tokens and then end-of-sequence."""
    compiled = grammars.compile(StructuredOutputs(json=schema))
    assert compiled.backend == "xgrammar"
    matcher = compiled.new_matcher()
    tokens = grammars._tokenizer.hf.encode(json.dumps(document), add_special_tokens=False)
    return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(min(grammars._tokenizer.eos_token_ids))


def test_the_probes_cover_every_keyword_that_constrains() -> None:
    annotations = {"title", "description", "default", "examples", "$schema", "$id", "$comment"}
    covered = {k for _, schema, _, _ in PROBES for k in json.dumps(schema).split('"') if k in ENFORCED_KEYWORDS}
    assert covered == ENFORCED_KEYWORDS - annotations


@pytest.mark.parametrize(("keyword", "schema", "valid", "invalid"), PROBES, ids=[p[0] for p in PROBES])
def test_each_enforced_keyword_is_enforced(grammars: GrammarCompiler, keyword: str, schema: dict, valid: Any,
                                           invalid: Any) -> None:
    jsonschema.validate(valid, schema)
    assert not jsonschema.Draft202012Validator(schema).is_valid(invalid)
    assert enforces(schema)
    assert accepts(grammars, schema, valid)
    assert not accepts(grammars, schema, invalid)


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^[0-9]{5}$"},
    {"type": "string", "format": "date"},
    {"allOf": [{"type": "integer"}, {"minimum": 3}]},
    {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    {"type": "number", "multipleOf": 0.5},
    {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
    {"type": "array", "items": [{"type": "integer"}]},  # draft-4 tuple items
    {"$ref": "https://example.com/schema.json"},
    {"type": "decimal"},
    {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string", "pattern": "a+"}}}},
], ids=["pattern", "format", "allOf", "oneOf", "multipleOf", "nested not", "tuple items", "remote $ref",
        "unknown type", "deep pattern"])
def test_schemas_with_other_keywords_stay_with_llguidance(grammars: GrammarCompiler, schema: dict) -> None:
    assert not enforces(schema)


def test_a_very_deep_schema_is_walked_without_recursion() -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    assert enforces(schema)
    schema["items"]["items"]["pattern"] = "x"
    assert not enforces(schema)


def test_a_done_or_broken_sequence_may_only_end(grammars: GrammarCompiler) -> None:
    tokenizer = grammars._tokenizer
    ends = sorted(t for t in tokenizer.eos_token_ids if t < tokenizer.vocab_size)
    eos = ends[0]
    compiled = grammars.compile(StructuredOutputs(json={"enum": ["yes", "no"]}))
    seqs = []
    for i in range(3):
        seq = Sequence(f"r{i}", 0, [1, 2, 3], SamplingParams(), 0, 0.0, None, torch.device("cpu"))
        seq.grammar = grammars.new_matcher(compiled)
        seqs.append(seq)
    done, broken, going = seqs
    done.token_ids += tokenizer.hf.encode('"yes"', add_special_tokens=False) + [eos]
    broken.token_ids += tokenizer.hf.encode("maybe", add_special_tokens=False)[:1]
    going.token_ids += tokenizer.hf.encode('"y', add_special_tokens=False)
    mask = TokenMasker(torch.device("cpu")).for_step(seqs)
    assert done.grammar.stopped and broken.grammar.rejected and not going.grammar.ends_only
    assert torch.equal(mask.words[0], compiled.stop_row) and torch.equal(mask.words[1], compiled.stop_row)
    allowed = ((mask.words[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().nonzero()
    assert allowed.flatten().tolist() == ends
    ongoing = ((mask.words[2].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().nonzero()
    assert eos not in ongoing.flatten().tolist() and len(ongoing) > 1
