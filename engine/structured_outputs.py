"""What a request's output must match (vLLM's StructuredOutputsParams): a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a grammar (GBNF as llama.cpp and vLLM write it, or Lark). Exactly one.

This module only checks the shape of the request; engine/grammar.py compiles it for a tokenizer."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# a constraint's text at most (a schema as compact JSON, the choices, the regex or grammar): compiling one is CPU
# work on the engine's thread, and OpenAI's own bound on a schema's names and values is 120,000 characters
MAX_CHARS = 100_000


@dataclass
class StructuredOutputs:
    json: dict[str, Any] | str | None = None  # a JSON schema, or its JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # GBNF (root ::= ...) or Lark (start: ...)
    # the request field errors name, as the client wrote it (e.g. response_format.json_schema.schema)
    field_name: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        name = self.field_name or "structured_outputs"
        if len(given) != 1:
            raise ValueError(f"{name}: exactly one of {', '.join(KINDS)} must be set, got "
                             f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        where = self.field
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"{where}: not valid JSON: {e}") from e
            if not isinstance(value, dict):
                raise ValueError(f"{where}: a JSON schema must be an object, got {type(value).__name__}")
            self.json = value
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"{where}: must be true")
        elif kind == "choice":
            if not isinstance(value, list) or not value:
                raise ValueError(f"{where}: must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"{where}: each choice must be a non-empty string")
            self.choice = list(value)
        elif not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: must be a non-empty string")
        size = len(value) if isinstance(value, str) else len(json.dumps(getattr(self, kind), separators=(",", ":")))
        if size > MAX_CHARS:
            raise ValueError(f"{where}: at most {MAX_CHARS} characters, got {size}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field(self) -> str:
        """The field that errors about this constraint name."""
        return self.field_name or f"structured_outputs.{self.kind}"

    @property
    def key(self) -> str:
        """A hash of what the output must match (not of field_name): compiled grammars are cached by it."""
        text = json.dumps([self.kind, getattr(self, self.kind)], sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def of(cls, value: StructuredOutputs | dict[str, Any]) -> StructuredOutputs:
        if isinstance(value, StructuredOutputs):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs: expected an object, got {type(value).__name__}")
        unknown = sorted(set(value) - {*KINDS, "field_name"})
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]}: not supported (supported: {', '.join(KINDS)})")
        return cls(**value)
