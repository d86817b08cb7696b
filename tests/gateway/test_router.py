import json
from collections import Counter
from pathlib import Path

import pytest

from gateway.router import TASKS, ModelSpec, choose_model, classify, route

LABELED = Path(__file__).resolve().parents[1] / "data" / "router_labeled.jsonl"

SMALL = {"name": "smollm2-135m", "size": "small", "tasks": ["chat", "classification", "extraction", "summarization"],
         "engine": {"max_model_len": 2048}}
LARGE = {"name": "llama-8b", "size": "large", "tasks": ["code", "math", "reasoning", "chat"], "max_model_len": 8192}
LONG = {"name": "small-32k", "size": "small", "tasks": ["long-context", "summarization"], "max_model_len": 32768}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def load_labeled() -> list[dict]:
    return [json.loads(line) for line in LABELED.read_text().splitlines() if line.strip()]


def test_labeled_set_is_large_and_covers_every_task():
    rows = load_labeled()
    assert len(rows) >= 200
    assert set(Counter(r["task"] for r in rows)) == set(TASKS)


def test_accuracy_on_labeled_set_is_at_least_90_percent():
    rows = load_labeled()
    correct = sum(classify(r["messages"]).task == r["task"] for r in rows)
    assert correct / len(rows) >= 0.90


@pytest.mark.parametrize(
    "text,task,model",
    [
        ("Write a Python function that merges two sorted lists.", "code", "llama-8b"),
        ("Solve for y: 2y - 4 = 10.", "math", "llama-8b"),
        ("Classify this review as positive or negative: 'awful'", "classification", "smollm2-135m"),
        ("Hello! How was your weekend?", "chat", "smollm2-135m"),
    ],
)
def test_route_by_size(text, task, model):
    decision = route(user(text), [SMALL, LARGE])
    assert (decision.task, decision.model) == (task, model)
    assert task in decision.header and model in decision.header


def test_long_context_goes_to_a_model_that_fits():
    doc = "The committee reviewed the proposal and asked for more numbers. " * 400
    decision = route(user("Summarize this report:\n" + doc), [SMALL, LARGE, LONG])
    assert decision.task == "long-context"
    assert decision.model == "small-32k"
    assert decision.prompt_tokens > 2000


def test_fallback_to_what_is_deployed():
    assert route(user("Write a bash script that lists files."), [SMALL]).model == "smollm2-135m"
    assert route(user("Hi there!"), [LARGE]).model == "llama-8b"


def test_no_model_fits_picks_longest_context():
    spec, reason = choose_model("long-context", 50_000, [SMALL, LARGE])
    assert spec.name == "llama-8b" and "no model fits" in reason


def test_max_tokens_counts_toward_fit():
    small = ModelSpec("s", "small", ("chat",), 1024)
    big = ModelSpec("b", "large", ("chat",), 4096)
    assert choose_model("chat", 500, [small, big], max_tokens=100)[0].name == "s"
    assert choose_model("chat", 500, [small, big], max_tokens=1000)[0].name == "b"


def test_system_prompt_and_content_parts():
    messages = [
        {"role": "system", "content": "You are a sentiment classifier. Answer positive or negative."},
        {"role": "user", "content": [{"type": "text", "text": "The food was cold and bland."}]},
    ]
    assert classify(messages).task == "classification"


def test_no_models_deployed_is_an_error():
    with pytest.raises(ValueError):
        route(user("hi"), [])
