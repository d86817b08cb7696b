"""Tools in a chat prompt. A chat template with a tool section (it reads `tools` and `tool_calls`: Qwen 2.5, Hermes,
Llama 3.1, Mistral) gets the tools and the tool-call history as Hugging Face's `apply_chat_template(tools=...)` passes
them. A template without one (SmolLM2's) gets the fallback format below, in plain messages it can render:

- the functions are listed in a block appended to the system prompt (a system message is added when there is none),
  with the output format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an assistant turn's tool calls are written in that format after its text;
- a `tool` message becomes a user turn holding `<tool_response>{"name": ..., "content": ...}</tool_response>`.

The Hermes parser (gateway/tool_calls/parsers.py) reads that output format."""

from __future__ import annotations

import json
import re
from typing import Any

FALLBACK_INSTRUCTIONS = (
    "# Tools\n\n"
    "You can call functions to answer the user. These are the functions, one JSON signature a line, inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write one JSON object with the function's name and its arguments inside "
    "<tool_call></tool_call>, one block per call:\n"
    '<tool_call>\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n</tool_call>\n'
    "A function's result comes back to you inside <tool_response></tool_response>."
)

_READS_TOOLS = re.compile(r"\btools\b")
_READS_TOOL_CALLS = re.compile(r"\btool_calls\b")


def template_has_tool_section(template: str | dict[str, str] | list[Any] | None) -> bool:
    """Whether the chat template (or one of a tokenizer's named templates, e.g. `tool_use`) renders tools and tool
    calls itself."""
    if isinstance(template, dict):
        return any(template_has_tool_section(t) for t in template.values())
    if isinstance(template, list):  # [{"name": ..., "template": ...}] as some tokenizer configs store them
        return any(template_has_tool_section(t.get("template")) for t in template if isinstance(t, dict))
    if not isinstance(template, str):
        return False
    return bool(_READS_TOOLS.search(template) and _READS_TOOL_CALLS.search(template))


def uses_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """The conversation in plain {role, content} messages with the tools written in the fallback format."""
    names_by_id = {call.get("id"): call["function"]["name"] for m in messages for call in m.get("tool_calls") or ()}
    out: list[dict[str, str]] = []
    for m in messages:
        if m.get("role") == "tool":
            response = {"name": names_by_id.get(m.get("tool_call_id"), ""), "content": m.get("content") or ""}
            out.append({"role": "user", "content": "<tool_response>\n" + json.dumps(response, ensure_ascii=False)
                        + "\n</tool_response>"})
        elif m.get("tool_calls"):
            blocks = [_call_block(call["function"]) for call in m["tool_calls"]]
            text = m.get("content") or ""
            out.append({"role": m["role"], "content": "\n".join(([text] if text else []) + blocks)})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        block = FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _call_block(function: dict[str, Any]) -> str:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # written as the string it is
    call = {"name": function["name"], "arguments": arguments}
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
