"""The official openai client against the live gateway over real HTTP."""

from __future__ import annotations

import time
from decimal import Decimal

import httpx
import openai
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.models import UsageEvent
from tests.gateway.conftest import MODEL

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server, tenant_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=tenant_key, max_retries=0)


def _event(server, shared_db, request_id: str) -> UsageEvent:
    """The request's usage event; a stream's is recorded just after its client reads [DONE], so it is waited for."""
    deadline = time.monotonic() + 10
    while True:
        server.gateway.ledger.flush(10)
        with Session(shared_db) as s:
            event = s.scalar(select(UsageEvent).where(UsageEvent.request_id == request_id))
        if event is not None or time.monotonic() > deadline:
            return event
        time.sleep(0.05)


def test_chat_plain_records_usage_and_cost(client, server, shared_db):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                       user="alice", metadata={"tags": "checkout"})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 5 and 1 <= r.usage.completion_tokens <= 6
    ev = _event(server, shared_db, r.id)
    assert (ev.status, ev.prompt_tokens, ev.completion_tokens) == ("ok", r.usage.prompt_tokens,
                                                                   r.usage.completion_tokens)
    assert ev.end_user == "alice" and ev.tags == ["search", "checkout"]
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    # exact: the spec's prices per 1M, the KV-cached prompt tokens at the input price (no cached price set)
    expected = (r.usage.prompt_tokens * Decimal("0.05") + r.usage.completion_tokens * Decimal("0.10")) / 10**6
    assert cached >= 0 and ev.cost_usd == expected.quantize(Decimal("0.000000001")) and ev.cost_usd > 0
    assert ev.latency_s > 0 and ev.ttft_s is not None and ev.ttft_s <= ev.latency_s


def test_chat_streamed_matches_plain_and_reports_usage(client, server, shared_db):
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert _event(server, shared_db, chunks[0].id).status == "ok"


def test_n_greater_than_one(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens == sum(1 for _ in r.choices) * 4 or r.usage.completion_tokens <= 12
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1] and all(texts.values())


def test_completions_with_logprobs_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=2)
    [choice] = r.choices
    assert r.object == "text_completion" and choice.text
    assert len(choice.logprobs.tokens) == r.usage.completion_tokens
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == choice.text
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[","])
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_logprobs_bytes_are_each_tokens_own_when_it_holds_part_of_a_character(client, backend):
    """A token holding the first bytes of a character has those bytes in `bytes` (not U+FFFD's) and its `token`
    shows them escaped (not U+FFFD); whole tokens show their text."""
    tokenizer = backend.engine.tokenizer
    part = next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes([i]) == b"\xe6\x97")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=3, logit_bias={str(part): 100})
    content = r.choices[0].logprobs.content
    assert [(t.token, t.bytes) for t in content] == [("\\xe6\\x97", [0xE6, 0x97])] * 3
    assert all(alt.token == bytes(alt.bytes).decode("utf-8", "backslashreplace")
               for t in content for alt in t.top_logprobs)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True)
    assert b"".join(bytes(t.bytes) for t in plain.choices[0].logprobs.content).decode() == \
        plain.choices[0].message.content


def _joined_bytes(content) -> str:
    return b"".join(bytes(t.bytes) for t in content).decode()


JAPANESE = [{"role": "user", "content": "日本の首都はどこですか？日本語で答えてください。"}]


@pytest.mark.parametrize("messages, stop", [(MESSAGES, None), (JAPANESE, "語")], ids=["english", "split-stop"])
def test_logprobs_are_the_contents_tokens_only_at_a_stop(client, messages, stop):
    """The end of sequence and the tokens a stop string cut off have no logprobs: the tokens' bytes put together are
    the content, streamed or whole. The Japanese answer's 語 is three byte tokens: a stop string that begins with it
    keeps none of them."""
    ended = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                           logprobs=True)
    content = ended.choices[0].message.content
    if messages is MESSAGES:  # SmolLM2 ends this answer itself (the Japanese one runs on)
        assert ended.choices[0].finish_reason == "stop"
        assert _joined_bytes(ended.choices[0].logprobs.content) == content
        assert len(ended.choices[0].logprobs.content) == ended.usage.completion_tokens - 1  # the end token is billed
    stop = stop or content[len(content) // 2:][:4]  # four characters from the middle of the answer
    assert stop in content
    for stream in (False, True):
        if stream:
            chunks = [c for c in client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=60, temperature=0, logprobs=True, stop=[stop],
                stream=True) if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        else:
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                               logprobs=True, stop=[stop])
            text, tokens = r.choices[0].message.content, r.choices[0].logprobs.content
        assert text == content[:content.index(stop)]
        joined = _joined_bytes(tokens)  # the last token may hold the stop string's beginning
        assert joined.startswith(text) and len(_joined_bytes(tokens[:-1])) < len(text), (stream, stop, joined)


def test_completions_text_offsets_are_where_each_token_begins(client):
    prompt = "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
    lp = whole.choices[0].logprobs
    text = whole.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]  # ASCII: a char a byte
    assert all(text[offset:].startswith(token) for offset, token in zip(lp.text_offset, lp.tokens))
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1, stream=True) if c.choices
        and c.choices[0].logprobs]
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset  # the offsets go on from chunk to chunk


def test_models_health_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "models": {MODEL: "ready"}}
    admin = server.app.state.admin_key
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {admin}"}).text
    assert 'tollgate_requests_total{endpoint="chat.completions",model="smollm2-135m",status="ok"}' in text
    assert "tollgate_engine_kv_blocks_free" in text


def test_metrics_carry_vllm_serving_series(client, server):
    """The series vLLM's dashboards read, named as close to its `vllm:` ones as fit: they move with traffic."""
    def scrape() -> dict[str, float]:
        admin = server.app.state.admin_key
        text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {admin}"}).text
        values = {}
        for line in text.splitlines():
            if line.startswith("tollgate_") and f'model="{MODEL}"' in line and "le=" not in line:
                name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                values[name] = values.get(name, 0.0) + value
        return values

    before = scrape()
    prompt = "Count from one to twenty in words, then back down to one, slowly and clearly. " * 3  # > 2 KV blocks
    for _ in range(2):  # the second reuses the first's prefix-cache blocks
        list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    after = scrape()
    for name in ("tollgate_num_requests_running", "tollgate_num_requests_waiting", "tollgate_kv_cache_usage_perc"):
        assert name in after
    assert after["tollgate_time_to_first_token_seconds_count"] == before["tollgate_time_to_first_token_seconds_count"] + 2
    assert after["tollgate_e2e_request_latency_seconds_count"] >= before["tollgate_e2e_request_latency_seconds_count"] + 2
    assert after["tollgate_request_queue_time_seconds_count"] >= before["tollgate_request_queue_time_seconds_count"] + 2
    assert after["tollgate_inter_token_latency_seconds_count"] >= before.get(
        "tollgate_inter_token_latency_seconds_count", 0) + 2 * 7
    assert after["tollgate_generation_tokens_total"] >= before["tollgate_generation_tokens_total"] + 16
    assert after["tollgate_prefix_cache_queries_total"] > before["tollgate_prefix_cache_queries_total"]
    assert after["tollgate_prefix_cache_hits_total"] > before["tollgate_prefix_cache_hits_total"]
