"""SemanticCache: per-namespace FAISS search, a same-question verifier, thresholds per bound and entry, TTL, LRU
bound, SQLite."""
from __future__ import annotations

import math
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from cache.bounds import Bound, FalseHitBounds, shipped_bounds
from cache.index import HNSW_THRESHOLD, NamespaceIndex
from cache.learning import ANSWER_AGREEMENT, EntryLabels, normalized
from cache.namespace import Namespace
from cache.pooled import ERROR_WINDOW, EXPLORE, TenantCalibration
from cache.store import EntryStore, FlagRecord, StoredEntry
from cache.types import CacheStats, Flagged, Hit, Lookup
from cache.verifier import DEFAULT_ARTIFACT, Verifier
from tollgate import envs

DB_FILENAME = "semantic_cache.sqlite3"
SAVE_EVERY_LABELS = 20  # a tenant's learned state is written after this many labels (and on close)


class TextEncoder(Protocol):
    dim: int

    def encode(self, texts: list[str]) -> np.ndarray: ...

    def sees_all_of(self, text: str) -> bool: ...


@dataclass
class _Entry:
    tenant: str
    namespace: str
    prompt: str
    answer: str
    usage: dict[str, Any]
    created: float
    last_used: float
    labels: EntryLabels


class SemanticCache:
    def __init__(
        self,
        directory: Path | str | None = None,
        *,
        embedder: TextEncoder | None = None,
        verifier: Verifier | None = None,
        ttl_s: float = 7 * 24 * 3600,
        max_entries: int = 200_000,
        top_k: int = 4,
        hnsw_threshold: int = HNSW_THRESHOLD,
        clock: Callable[[], float] = time.time,
        bounds: FalseHitBounds | None = None,
        learn: bool = True,
        explore: float = EXPLORE,
        seed: int | None = None,
        error_window: int | None = ERROR_WINDOW,
    ) -> None:
        """`bounds`: the threshold for each false-hit bound (default: the shipped table when the verifier is the
        shipped one it was calibrated for, else the verifier's own threshold for every bound). `learn`: whether
        thresholds move with labels, each tenant's (cache/pooled.py) and each entry's (cache/learning.py); off, every
        entry keeps its bound's threshold. `explore`: the share of would-be hits (not word-for-word repeats) returned
        as `learning` so the model's answer labels them; `seed` fixes which. `error_window`: a learned threshold keeps
        the false hits of every window of this many lookups <= δ (None: on average; cache/pooled.py)."""
        if embedder is None:
            from cache.embedder import shared_embedder

            embedder = shared_embedder()
        self.embedder = embedder
        self.verifier = verifier or load_default_verifier()
        self.bounds = bounds or default_bounds(self.verifier)
        self.learn_enabled = learn
        self.explore = explore if learn else 0.0
        self.error_window = error_window
        self._rng = random.Random(seed)
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.top_k = top_k
        self.hnsw_threshold = hnsw_threshold
        self._clock = clock
        self._lock = threading.RLock()
        db_path = None
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            db_path = Path(directory) / DB_FILENAME
        self._store = EntryStore(db_path)
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest use first
        self._indexes: dict[tuple[str, str], NamespaceIndex] = {}
        self._exact: dict[tuple[str, str, str], int] = {}
        self._stats: dict[str, CacheStats] = {}
        self._calibrations: dict[str, TenantCalibration] = {}
        self._unsaved_labels: dict[str, int] = {}
        self._load()
        self._next_id = self._store.next_id()

    # ---- public API -------------------------------------------------------------------------

    def lookup(self, namespace: Namespace, prompt: str, embedding: np.ndarray | None = None,
               max_false_hit_rate: float | None = None) -> Hit | None:
        return self.consult(namespace, prompt, embedding, max_false_hit_rate).hit

    def consult(self, namespace: Namespace, prompt: str, embedding: np.ndarray | None = None,
                max_false_hit_rate: float | None = None) -> Lookup:
        """Hit, learning or miss at the bound `max_false_hit_rate` (δ; None: the default, cache/bounds.py)."""
        bound = self.bounds.at(max_false_hit_rate)
        now = self._clock()
        with self._lock:  # the same prompt in the same namespace needs neither the embedder nor the verifier
            exact = self._exact_served(namespace, prompt, now, bound)
            if exact is not None:
                return exact
        if embedding is None and not self.embedder.sees_all_of(prompt):
            with self._lock:  # longer than the embedder reads: only the very same text may be served
                self._observe(namespace.tenant, None)
                return self._count(namespace, Lookup("miss"), now)
        q = self._embed(prompt) if embedding is None else embedding
        now = self._clock()
        with self._lock:  # the same prompt may have been stored while it was embedded: it is still the same text
            exact = self._exact_served(namespace, prompt, now, bound)
            if exact is not None:
                return exact
            return self._count(namespace, self._best_candidate(namespace, prompt, q, now, bound), now)

    def _exact_served(self, ns: Namespace, prompt: str, now: float, bound: Bound) -> Lookup | None:
        """The exact-prompt hit, counted, or None. Under the lock."""
        exact = self._exact_hit(ns, prompt, now, bound)
        if exact is None:
            return None
        self._observe(ns.tenant, None)
        return self._count(ns, exact, now)

    def learn(self, namespace: Namespace, entry_id: int, score: float, answer: str,
              answer_embedding: np.ndarray | None = None, explored: bool = False) -> bool | None:
        """The model's fresh `answer` to a prompt that scored `score` against entry `entry_id` (a `learning` lookup;
        `explored`: its Lookup.explored) labels the entry: the same answer (word for word, or embeddings at
        ANSWER_AGREEMENT or closer) says the two prompts ask the same thing. Returns the label, or None when the entry
        is gone or another namespace's."""
        with self._lock:
            entry = self._entries.get(entry_id)
            if entry is None or entry.tenant != namespace.tenant or entry.namespace != namespace.key:
                return None
            cached = entry.answer
        same = normalized(answer) == normalized(cached)
        if not same:
            vecs = self.embedder.encode([cached, answer]) if answer_embedding is None else np.stack(
                [self.embedder.encode([cached])[0], answer_embedding])
            same = float(vecs[0] @ vecs[1]) >= ANSWER_AGREEMENT
        self.label(namespace, entry_id, score, same, explored=explored)
        return same

    def label(self, namespace: Namespace, entry_id: int, score: float, same: bool, pooled: bool = True,
              explored: bool = False) -> None:
        """Records that a prompt scoring `score` against the entry asked the same question (or not). `pooled`: the
        label also teaches the tenant's threshold (cache/pooled.py): true for lookups labelled whatever their answer
        (`learning` ones), false for flags, which only wrong hits produce. `explored`: the lookup was a would-be hit
        sent to the model (Lookup.explored), one of a share `explore` of them."""
        if not self.learn_enabled and same:
            return
        with self._lock:
            entry = self._entries.get(entry_id)
            if entry is None or entry.tenant != namespace.tenant or entry.namespace != namespace.key:
                return
            entry.labels.add(score, same)
            if entry.labels.flagged_exact:
                self._remove([entry_id])
            else:
                self._store.save_labels(entry_id, entry.labels.to_json())
            if not (pooled and self.learn_enabled):
                return
            calibration = self._calibration(namespace.tenant)
            calibration.add_label(score, same, 1.0 / self.explore if explored and self.explore else 1.0)
            scores, labels = calibration.snapshot()
        # outside the lock: lookups go on meanwhile
        thresholds = TenantCalibration.refit(scores, labels, self.bounds.all, self.error_window)
        with self._lock:
            calibration.thresholds = thresholds
            unsaved = self._unsaved_labels[namespace.tenant] = self._unsaved_labels.get(namespace.tenant, 0) + 1
            if unsaved >= SAVE_EVERY_LABELS:
                self._save_calibration(namespace.tenant)

    def learned_thresholds(self, tenant: str) -> dict[float, float]:
        """δ -> the threshold this tenant's lookups are served from now (the calibrated one where nothing is learned
        yet); an entry's own labels may move it further (cache/learning.py)."""
        with self._lock:
            calibration = self._calibrations.get(tenant)
            return {b.max_false_hit_rate: b.threshold if calibration is None else calibration.threshold(b)
                    for b in self.bounds.all}

    def label_count(self, tenant: str) -> int:
        """The labels the tenant's threshold was learned from (the latest cache/pooled.py keeps)."""
        with self._lock:
            calibration = self._calibrations.get(tenant)
            return 0 if calibration is None else len(calibration.labels)

    def note_served(self, response_id: str, namespace: Namespace, lookup: Lookup) -> None:
        """Remembers which entry answered `response_id`, so its client can flag the answer (flag())."""
        if lookup.hit is None or lookup.score is None:
            return
        with self._lock:
            self._store.record_served(response_id, namespace.tenant, lookup.hit.entry_id, lookup.score,
                                      self._clock())

    def flag(self, tenant: str, response_id: str) -> Flagged | None:
        """A client says the cached answer it got as `response_id` was wrong: the entry stops serving prompts
        scoring that low or lower at once (all of them when the prompt was the same text). None: no answer of
        `tenant`'s was served under that id (another tenant's ids are as unknown as made-up ones)."""
        with self._lock:
            row = self._store.served(response_id)
            if row is None or row.tenant != tenant:
                return None
            entry = self._entries.get(row.entry_id)
            if entry is None:
                return Flagged(response_id, row.entry_id, row.score, True, None)
            self.label(Namespace(entry.tenant, entry.namespace), row.entry_id, row.score, False, pooled=False)
            removed = row.entry_id not in self._entries
            threshold = None if removed else self._entry_threshold(entry, self.bounds.at(None))
            self._store.record_flag(FlagRecord(response_id, tenant, row.entry_id, entry.prompt, row.score, removed,
                                               self._clock()))
            return Flagged(response_id, row.entry_id, row.score, removed, threshold)

    def flagged(self, tenant: str | None = None, limit: int = 100) -> list[FlagRecord]:
        """The answers clients flagged as wrong, the latest first (one tenant's, or every tenant's)."""
        return self._store.flags(tenant, limit)

    def tenant_report(self) -> dict[str, dict[str, Any]]:
        """Per tenant with entries, flags or labels: entries, flagged answers, labels learned from, and the threshold
        its lookups are served from at each bound (cache/pooled.py): for the dashboard."""
        flags = self._store.flag_counts()
        with self._lock:
            entries: dict[str, int] = {}
            for e in self._entries.values():
                entries[e.tenant] = entries.get(e.tenant, 0) + 1
            tenants = set(entries) | set(flags) | set(self._calibrations)
            return {t: {"entries": entries.get(t, 0), "flagged": flags.get(t, 0),
                        "labels": len(self._calibrations[t].labels) if t in self._calibrations else 0,
                        "thresholds": {b.max_false_hit_rate: (self._calibrations[t].threshold(b)
                                                              if t in self._calibrations else b.threshold)
                                       for b in self.bounds.all}}
                    for t in tenants}

    def store(
        self,
        namespace: Namespace,
        prompt: str,
        answer: str,
        usage: Mapping[str, Any] | None = None,
        embedding: np.ndarray | None = None,
    ) -> int:
        emb = None if embedding is None else embedding[None, :]
        return self.store_many(namespace, [prompt], [answer], [usage or {}], emb)[0]

    def store_many(
        self,
        namespace: Namespace,
        prompts: list[str],
        answers: list[str],
        usages: list[Mapping[str, Any]],
        embeddings: np.ndarray | None = None,
    ) -> list[int]:
        vecs = self.embedder.encode(list(prompts)) if embeddings is None else embeddings
        now = self._clock()
        with self._lock:
            ids: list[int] = []
            rows: list[StoredEntry] = []
            for prompt, answer, usage, vec in zip(prompts, answers, usages, vecs):
                old = self._exact.get((namespace.tenant, namespace.key, prompt))
                if old is not None:
                    self._remove([old])
                entry_id = self._next_id
                self._next_id += 1
                entry = _Entry(namespace.tenant, namespace.key, prompt, answer, dict(usage), now, now, EntryLabels())
                self._add(entry_id, entry, vec)
                rows.append(StoredEntry(entry_id, entry.tenant, entry.namespace, prompt, vec, answer,
                                        entry.usage, now, now))
                ids.append(entry_id)
            self._store.insert_many(rows)
            self._evict_over_bound()
            return ids

    def flush(self, tenant: str) -> int:
        """Remove every entry of `tenant`; returns how many were removed."""
        with self._lock:
            ids = [i for i, e in self._entries.items() if e.tenant == tenant]
            for i in ids:
                self._forget(i)
            for key in [k for k in self._indexes if k[0] == tenant]:
                del self._indexes[key]
            self._calibrations.pop(tenant, None)
            self._unsaved_labels.pop(tenant, None)
            self._store.delete_tenant(tenant)
            return len(ids)

    def purge_expired(self) -> int:
        with self._lock:
            cutoff = self._clock() - self.ttl_s
            ids = [i for i, e in self._entries.items() if e.created < cutoff]
            self._remove(ids)
            self._store.forget_served_before(cutoff)
            return len(ids)

    def stats(self, tenant: str | None = None) -> CacheStats:
        with self._lock:
            if tenant is not None:
                s = self._stats.get(tenant, CacheStats())
                n = sum(1 for e in self._entries.values() if e.tenant == tenant)
                return CacheStats(s.lookups, s.hits, s.saved_prompt_tokens, s.saved_completion_tokens,
                                  s.saved_dollars, n)
            total = CacheStats(entries=len(self._entries))
            for s in self._stats.values():
                total.lookups += s.lookups
                total.hits += s.hits
                total.saved_prompt_tokens += s.saved_prompt_tokens
                total.saved_completion_tokens += s.saved_completion_tokens
                total.saved_dollars += s.saved_dollars
            return total

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        with self._lock:
            for tenant in list(self._unsaved_labels):
                self._save_calibration(tenant)
        self._store.close()

    # ---- internals --------------------------------------------------------------------------

    def _embed(self, prompt: str) -> np.ndarray:
        return self.embedder.encode([prompt])[0]

    def _count(self, namespace: Namespace, lookup: Lookup, now: float) -> Lookup:
        """Records a lookup's outcome (stats, LRU order, the entry's last use) and returns it."""
        stats = self._stats.setdefault(namespace.tenant, CacheStats())
        stats.lookups += 1
        hit = lookup.hit
        if hit is None:
            self._store.bump_counters(namespace.tenant, 1, 0, 0, 0, 0.0)
            return lookup
        entry = self._entries[hit.entry_id]
        entry.last_used = now
        self._lru.move_to_end(hit.entry_id)
        self._store.record_hit(hit.entry_id, now)
        pt, ct, dollars = _usage_numbers(entry.usage)
        stats.hits += 1
        stats.saved_prompt_tokens += pt
        stats.saved_completion_tokens += ct
        stats.saved_dollars += dollars
        self._store.bump_counters(namespace.tenant, 1, 1, pt, ct, dollars)
        return lookup

    def _calibration(self, tenant: str) -> TenantCalibration:
        calibration = self._calibrations.get(tenant)
        if calibration is None:
            calibration = self._calibrations[tenant] = TenantCalibration()
        return calibration

    def _observe(self, tenant: str, score: float | None) -> None:
        if self.learn_enabled:
            self._calibration(tenant).observe(score)

    def _save_calibration(self, tenant: str) -> None:
        calibration = self._calibrations.get(tenant)
        if calibration is not None:
            self._store.save_calibration(tenant, calibration.to_json())
        self._unsaved_labels.pop(tenant, None)

    def _entry_threshold(self, entry: _Entry, bound: Bound) -> float:
        if not self.learn_enabled:
            blocked = entry.labels.blocked_up_to  # flags still count: a flagged answer is never served there again
            return bound.threshold if blocked is None else max(bound.threshold, math.nextafter(blocked, math.inf))
        return entry.labels.threshold(bound, self._calibration(entry.tenant).threshold(bound))

    def _exact_hit(self, ns: Namespace, prompt: str, now: float, bound: Bound) -> Lookup | None:
        """The live entry stored for this very prompt in this namespace, if any (an expired one is left to
        _best_candidate, which removes it)."""
        entry_id = self._exact.get((ns.tenant, ns.key, prompt))
        entry = None if entry_id is None else self._entries.get(entry_id)
        if entry is None or now - entry.created > self.ttl_s:
            return None
        threshold = self._entry_threshold(entry, bound)
        hit = Hit(entry_id, entry.answer, dict(entry.usage), 1.0, 1.0, entry.prompt, threshold)
        return Lookup("hit", hit, entry_id, 1.0, threshold)

    def _best_candidate(self, ns: Namespace, prompt: str, q: np.ndarray, now: float, bound: Bound) -> Lookup:
        index = self._indexes.get((ns.tenant, ns.key))
        if index is None:
            self._observe(ns.tenant, None)
            return Lookup("miss")
        cands: list[tuple[int, float]] = []
        expired: list[int] = []
        for entry_id, cos in index.search(q, self.top_k):
            entry = self._entries.get(entry_id)
            # The index is per (tenant, namespace); the check below is defence in depth.
            if entry is None or entry.tenant != ns.tenant or entry.namespace != ns.key:
                continue
            if now - entry.created > self.ttl_s:
                expired.append(entry_id)
                continue
            if cos >= self.verifier.min_cosine:
                cands.append((entry_id, cos))
        if expired:
            self._remove(expired)
        if not cands:
            self._observe(ns.tenant, None)
            return Lookup("miss")
        texts = [self._entries[i].prompt for i, _ in cands]
        vecs = np.stack([index.vector(i) for i, _ in cands])
        probs = self.verifier.score_pairs([prompt] * len(cands), texts, np.repeat(q[None, :], len(cands), 0), vecs)
        self._observe(ns.tenant, float(np.max(probs)))
        thresholds = [self._entry_threshold(self._entries[i], bound) for i, _ in cands]
        serving = [j for j in range(len(cands)) if probs[j] >= thresholds[j]]
        if serving:  # the most likely same question among the entries that serve at their scores
            j = max(serving, key=lambda k: probs[k])
            entry_id, cos = cands[j]
            entry = self._entries[entry_id]
            score = float(probs[j])
            if self.explore and self._rng.random() < self.explore:  # the model answers: a label where it serves
                return Lookup("learning", None, entry_id, score, thresholds[j], explored=True)
            hit = Hit(entry_id, entry.answer, dict(entry.usage), cos, score, entry.prompt, thresholds[j])
            return Lookup("hit", hit, entry_id, score, thresholds[j])
        j = int(np.argmax(probs))
        score = float(probs[j])
        state = "learning" if self.learn_enabled and score >= bound.learning_floor else "miss"
        return Lookup(state, None, cands[j][0], score, thresholds[j])

    def _add(self, entry_id: int, entry: _Entry, vec: np.ndarray) -> None:
        key = (entry.tenant, entry.namespace)
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = NamespaceIndex(vec.shape[-1], self.hnsw_threshold)
        index.add(np.array([entry_id]), vec[None, :])
        self._entries[entry_id] = entry
        self._lru[entry_id] = None
        self._lru.move_to_end(entry_id)
        self._exact[(entry.tenant, entry.namespace, entry.prompt)] = entry_id

    def _forget(self, entry_id: int) -> _Entry | None:
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return None
        self._lru.pop(entry_id, None)
        exact_key = (entry.tenant, entry.namespace, entry.prompt)
        if self._exact.get(exact_key) == entry_id:  # a later entry for the same prompt (another process's) stays
            del self._exact[exact_key]
        return entry

    def _remove(self, ids: list[int]) -> None:
        for entry_id in ids:
            entry = self._forget(entry_id)
            if entry is None:
                continue
            key = (entry.tenant, entry.namespace)
            index = self._indexes.get(key)
            if index is not None:
                index.remove(entry_id)
                if len(index) == 0:
                    del self._indexes[key]
        self._store.delete(ids)

    def _evict_over_bound(self) -> None:
        excess = len(self._entries) - self.max_entries
        if excess > 0:
            self._remove([i for i, _ in zip(self._lru, range(excess))])

    def _load(self) -> None:
        cutoff = self._clock() - self.ttl_s
        expired: list[int] = []
        groups: dict[tuple[str, str], list[StoredEntry]] = {}
        for row in self._store.load():  # ordered by last_used: LRU order is rebuilt as we go
            if row.created < cutoff:
                expired.append(row.id)
                continue
            self._entries[row.id] = _Entry(row.tenant, row.namespace, row.prompt, row.answer, row.usage,
                                           row.created, row.last_used, EntryLabels.from_json(row.labels))
            self._lru[row.id] = None
            self._exact[(row.tenant, row.namespace, row.prompt)] = row.id
            groups.setdefault((row.tenant, row.namespace), []).append(row)
        for key, rows in groups.items():
            index = self._indexes[key] = NamespaceIndex(rows[0].embedding.shape[0], self.hnsw_threshold)
            index.add(np.array([r.id for r in rows]), np.stack([r.embedding for r in rows]))
        self._store.delete(expired)
        for tenant, (lookups, hits, pt, ct, dollars) in self._store.counters().items():
            self._stats[tenant] = CacheStats(lookups, hits, pt, ct, dollars)
        for tenant, state in self._store.calibrations().items():
            self._calibrations[tenant] = TenantCalibration.from_json(state)
        self._evict_over_bound()


def _usage_numbers(usage: Mapping[str, Any]) -> tuple[int, int, float]:
    return (
        int(usage.get("prompt_tokens", 0) or 0),
        int(usage.get("completion_tokens", 0) or 0),
        float(usage.get("cost_usd", 0.0) or 0.0),
    )


def load_default_verifier() -> Any:
    """The shipped verifier: the cross-encoder when its artifact is there, else the MLP."""
    from cache.cross_verifier import DEFAULT_CROSS, CrossVerifier

    if DEFAULT_CROSS.exists():
        return CrossVerifier(DEFAULT_CROSS)
    return Verifier.load()


def default_bounds(verifier: Any) -> FalseHitBounds:
    """The shipped table for the verifier it was calibrated for; the verifier's own threshold for any other."""
    if getattr(verifier, "source", None) == DEFAULT_ARTIFACT:
        return shipped_bounds()
    return FalseHitBounds.single(float(verifier.threshold))


def default_cache_dir() -> Path:
    return envs.home() / "cache"
