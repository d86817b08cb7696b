"""What a chat request's tools ask of the model, checked before it runs: the tools the prompt lists, the constraint
that enforces `tool_choice: required` or a named function, and the parser that reads the calls from the output.
Every problem is a 400 naming the field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool

from engine.grammar import check as check_constraint
from engine.structured_outputs import StructuredOutputs
from engine.tool_prompt import FALLBACK_INSTRUCTIONS
from gateway.errors import invalid_request
from gateway.protocol import ChatCompletionRequest
from gateway.schema_check import check_json_schema, closed_schema
from gateway.specs import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from gateway.tool_calls.parsers import (ForcedCallsParser, HermesParser, Llama3JsonParser, NamedCallParser,
                                        ToolCallParser)
from gateway.tool_calls.request import NamedToolChoice

# the model formats `auto` reads (a model spec's `tool_parser`), and the key each writes a call's arguments under
PARSERS = {"hermes": (HermesParser, "arguments"), "llama3_json": (Llama3JsonParser, "parameters")}
assert set(PARSERS) == set(TOOL_PARSERS)
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# objects and arrays inside one tool's parameters at most: the schema checks recurse (a schema level is two: a
# property's name, then its schema), and real tools nest a few levels
MAX_SCHEMA_NESTING = 64

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # for the chat template (none with tool_choice "none")
    schemas: dict[str, dict[str, Any]]  # each function's parameters schema, as the client sent it
    mode: Mode
    named: str | None
    parallel: bool
    parser: str
    constraint: StructuredOutputs | None  # for required and named

    def new_parser(self) -> ToolCallParser | None:
        """A parser for one choice's output; None with tool_choice "none" (the output is text)."""
        if self.mode == "none":
            return None
        if self.mode == "named":
            assert self.named is not None
            return NamedCallParser(self.named)
        parser, key = PARSERS[self.parser]
        if self.mode == "required":
            return ForcedCallsParser(key)
        return parser(frozenset(self.schemas), self.parallel)


async def tool_plan(body: ChatCompletionRequest, parser: str = DEFAULT_TOOL_PARSER) -> ToolPlan | None:
    """The request's plan, or None when it has no tools; an APIError (400) naming the field otherwise."""
    for legacy in ("functions", "function_call"):
        if getattr(body, legacy) is not None:
            raise invalid_request(f"{legacy}: the deprecated functions API is not supported; send "
                                  f"{'tools' if legacy == 'functions' else 'tool_choice'} instead", legacy)
    if not body.tools:
        if body.tools is not None:
            raise invalid_request("tools: must hold at least one tool", "tools")
        for field in ("tool_choice", "parallel_tool_calls"):
            if getattr(body, field) is not None:
                raise invalid_request(f"{field}: only allowed when tools are given", field)
        return None
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(body.tools):
        name = tool.function.name
        if name in schemas:
            raise invalid_request(f"tools.{i}.function.name: `{name}` names two tools; names must be unique",
                                  f"tools.{i}.function.name")
        schemas[name] = _checked_parameters(tool.function.parameters, f"tools.{i}.function.parameters")
    choice = body.tool_choice or "auto"
    named = None
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if named not in schemas:
            raise invalid_request(f"tool_choice.function.name: `{named}` is not one of the tools "
                                  f"({', '.join(schemas)})", "tool_choice.function.name")
    mode: Mode = "named" if named else choice  # type: ignore[assignment]
    parallel = body.parallel_tool_calls is not False
    try:
        constraint = _constraint(mode, named, schemas, parallel, PARSERS[parser][1])
    except ValueError as e:  # the combined schema past the constraint size bound
        raise invalid_request(str(e), "tool_choice") from None
    plan = ToolPlan(tools=[] if mode == "none" else [t.model_dump(exclude_none=True) for t in body.tools],
                    schemas=schemas, mode=mode, named=named, parallel=parallel, parser=parser, constraint=constraint)
    if plan.constraint is not None:
        enforced = [named] if named else list(schemas)
        await run_in_threadpool(_check_enforceable, body, enforced)
    return plan


def _checked_parameters(parameters: dict[str, Any] | None, field: str) -> dict[str, Any]:
    if parameters is None:
        return NO_PARAMETERS
    if _nesting(parameters) > MAX_SCHEMA_NESTING:
        raise invalid_request(f"{field}: nested deeper than {MAX_SCHEMA_NESTING} levels", field)
    check_json_schema(parameters, field)
    if parameters.get("type", "object") != "object":
        raise invalid_request(f"{field}: must describe an object (type: object), got type {parameters['type']!r}",
                              field)
    return parameters


def _nesting(value: Any) -> int:
    """How deep objects and arrays nest in `value`, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_enforceable(body: ChatCompletionRequest, names: list[str]) -> None:
    """llguidance compiles each enforced function's arguments schema; a refusal names that tool's parameters."""
    assert body.tools is not None
    for i, tool in enumerate(body.tools):
        if tool.function.name in names:
            field = f"tools.{i}.function.parameters"
            schema = closed_schema(tool.function.parameters or NO_PARAMETERS)
            try:
                check_constraint(StructuredOutputs(json=schema, field_name=field))
            except ValueError as e:
                raise invalid_request(str(e), field) from None


def _constraint(mode: Mode, named: str | None, schemas: dict[str, dict[str, Any]], parallel: bool,
                arguments_key: str) -> StructuredOutputs | None:
    """Named: the output is the function's arguments object. Required: one call object `{"name", <key>}` (an array
    of one or more with parallel calls) of any tool."""
    if mode == "named":
        assert named is not None
        return StructuredOutputs(json=closed_schema(schemas[named]), field_name="tool_choice")
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name}, arguments_key: closed_schema(schema)},
              "required": ["name", arguments_key], "additionalProperties": False}
             for name, schema in schemas.items()]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": call, "minItems": 1} if parallel else call
    return StructuredOutputs(json=schema, field_name="tool_choice")


def tools_prompt_bytes(plan: ToolPlan | None) -> int:
    """At least the UTF-8 bytes the tools add to a prompt, however the template writes them (indented JSON at most)
    or the fallback block does."""
    if plan is None or not plan.tools:
        return 0

    return len(json.dumps(plan.tools, indent=4, ensure_ascii=False).encode()) + len(FALLBACK_INSTRUCTIONS.encode())
