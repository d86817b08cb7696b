"""xgrammar, the mask backend for JSON schemas whose every keyword it enforces (engine/grammar.py picks it).

llguidance builds each mask by walking the tokenizer's trie through a lazily built lexer; xgrammar precomputes, when
it compiles a schema, which tokens each grammar position allows whatever the stack below it, so its masks cost a
tenth to a twentieth of llguidance's (docs/benchmarks/structured.md). But xgrammar accepts some keywords without
enforcing them (allOf, multipleOf on floats, oneOf read as anyOf, ...): only schemas made of the keywords below, which
it was checked to enforce (tests/engine/test_xgrammar_backend.py walks a valid and an invalid document of each),
come here. Everything else stays with llguidance, which refuses what it cannot enforce.

Its settings match llguidance's (engine/grammar.py): json.dumps' separators and no other whitespace, and an absent
`additionalProperties` or `items` means JSON Schema's "anything" (strict_mode off), so a schema allows the same
documents whichever library serves it."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "

# keywords xgrammar enforces (or that do not constrain: annotations); a schema with any other goes to llguidance
ENFORCED_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minProperties", "maxProperties",
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
})
# keywords whose value is a schema, a list of schemas or a map of names to schemas
_SCHEMA_VALUED = {"additionalProperties", "items"}
_SCHEMA_LISTS = {"prefixItems", "anyOf"}
_SCHEMA_MAPS = {"properties", "$defs", "definitions"}
_JSON_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


def enforces(schema: Any) -> bool:
    """Whether xgrammar enforces every keyword of this JSON schema, nested schemas included. Walks iteratively:
    deep nesting costs no recursion."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict) or not set(node) <= ENFORCED_KEYWORDS:
            return False
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/"))):
            return False
        kinds = node.get("type")
        if kinds is not None and not all(k in _JSON_TYPES for k in (kinds if isinstance(kinds, list) else [kinds])):
            return False
        for key, value in node.items():
            if key in _SCHEMA_VALUED:
                stack.append(value)
            elif key in _SCHEMA_LISTS:
                if not isinstance(value, list):
                    return False
                stack.extend(value)
            elif key in _SCHEMA_MAPS:
                if not isinstance(value, dict):
                    return False
                stack.extend(value.values())
    return True


@functools.lru_cache(maxsize=1)
def _xgrammar() -> Any:
    import xgrammar

    return xgrammar


def available() -> bool:
    try:
        _xgrammar()
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=4)
def _compiler(tokenizer: Tokenizer, vocab_size: int, eos: tuple[int, ...], threads: int) -> Any:
    """xgrammar's compiler for a tokenizer (its token table read once per process and tokenizer, as llguidance's)."""
    xgr = _xgrammar()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size, stop_token_ids=list(eos))
    return xgr.GrammarCompiler(info, max_threads=threads)


class XGrammarCompiled:
    """A JSON schema compiled by xgrammar: each sequence gets a matcher of its own (they share the compiled tables,
    read only)."""

    backend = "xgrammar"

    def __init__(self, key: str, compiled: Any, stop_row: torch.Tensor) -> None:
        self.key = key
        self.compiled = compiled
        self.stop_row = stop_row  # the mask that allows only end-of-sequence (a rejected or finished sequence's)

    def new_matcher(self) -> Any:
        return _xgrammar().GrammarMatcher(self.compiled)


def compile_schema(key: str, schema: Any, tokenizer: Tokenizer, vocab_size: int, eos: tuple[int, ...],
                   threads: int) -> XGrammarCompiled:
    compiler = _compiler(tokenizer, vocab_size, eos, threads)
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                            separators=(ITEM_SEPARATOR, KEY_SEPARATOR), strict_mode=False)
    return XGrammarCompiled(key, compiled, only_tokens(eos, vocab_size))


def only_tokens(tokens: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """A mask row (int32 words, bit j of word w for token 32 * w + j) that allows these tokens only."""
    words = [0] * -(-vocab_size // 32)
    for token in tokens:
        words[token // 32] |= 1 << (token % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


class XGrammarFiller:
    """Fills the masks of a step's xgrammar rows and has their matchers accept tokens, in one call each (xgrammar
    lets the GIL go inside them)."""

    def __init__(self, threads: int) -> None:
        self._batch = _xgrammar().BatchGrammarMatcher(max_threads=threads)

    def fill(self, words: torch.Tensor, matchers: list[Any], rows: list[int]) -> None:
        self._batch.batch_fill_next_token_bitmask(matchers, words, rows)

    @staticmethod
    def accept(matchers: list[Any], tokens: list[int]) -> list[bool]:
        return list(_xgrammar().BatchGrammarMatcher.batch_accept_token(matchers, tokens))
