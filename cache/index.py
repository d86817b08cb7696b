"""FAISS search over one namespace: exact inner product while small, HNSW above a size bound.

Exact IndexFlatIP scans every vector, so its cost grows linearly; bench/cache.py measures where
it stops fitting the latency budget (HNSW_THRESHOLD). HNSW cannot delete, so removed ids become
tombstones and the graph is rebuilt once they pile up.
"""
from __future__ import annotations

import faiss
import numpy as np

# One query at a time: FAISS's OpenMP threads only add contention on a small shared CPU
# (bench/cache.py measured a 20k exact search at 20 ms p50 with them, under 2 ms without).
faiss.omp_set_num_threads(1)

HNSW_THRESHOLD = 20_000
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 64
HNSW_EF_SEARCH = 64


class NamespaceIndex:
    def __init__(self, dim: int, hnsw_threshold: int = HNSW_THRESHOLD) -> None:
        self.dim = dim
        self.hnsw_threshold = hnsw_threshold
        self._flat: faiss.IndexIDMap2 | None = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._hnsw: faiss.IndexHNSWFlat | None = None
        self._pos_ids: list[int] = []  # HNSW position -> entry id
        self._id_pos: dict[int, int] = {}
        self._dead: set[int] = set()

    @property
    def approximate(self) -> bool:
        return self._hnsw is not None

    def __len__(self) -> int:
        if self._flat is not None:
            return int(self._flat.ntotal)
        return len(self._id_pos) - len(self._dead)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if self._flat is not None:
            self._flat.add_with_ids(vectors, ids)
            if self._flat.ntotal > self.hnsw_threshold:
                self._to_hnsw()
            return
        assert self._hnsw is not None
        for i in ids.tolist():
            self._id_pos[i] = len(self._pos_ids)
            self._pos_ids.append(i)
        self._hnsw.add(vectors)

    def remove(self, entry_id: int) -> None:
        if self._flat is not None:
            self._flat.remove_ids(np.array([entry_id], dtype=np.int64))
            return
        if entry_id in self._id_pos and entry_id not in self._dead:
            self._dead.add(entry_id)
            if len(self._dead) >= 32 and len(self._dead) > len(self._id_pos) // 4:
                self._rebuild()

    def vector(self, entry_id: int) -> np.ndarray:
        if self._flat is not None:
            return self._flat.reconstruct(int(entry_id))
        assert self._hnsw is not None
        return self._hnsw.reconstruct(self._id_pos[entry_id])

    def search(self, query: np.ndarray, k: int) -> list[tuple[int, float]]:
        """Up to k live (entry id, cosine) pairs, best first."""
        q = np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32)
        if self._flat is not None:
            if self._flat.ntotal == 0:
                return []
            scores, ids = self._flat.search(q, min(k, int(self._flat.ntotal)))
            return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]
        assert self._hnsw is not None
        want = min(k + len(self._dead), len(self._pos_ids))
        scores, pos = self._hnsw.search(q, want)
        out: list[tuple[int, float]] = []
        for p, s in zip(pos[0], scores[0]):
            if p < 0:
                continue
            i = self._pos_ids[p]
            if i not in self._dead:
                out.append((i, float(s)))
                if len(out) == k:
                    break
        return out

    def _live(self) -> tuple[np.ndarray, np.ndarray]:
        if self._flat is not None:
            n = int(self._flat.ntotal)
            ids = faiss.vector_to_array(self._flat.id_map).astype(np.int64)
            return ids, self._flat.index.reconstruct_n(0, n)
        assert self._hnsw is not None
        keep = [p for p, i in enumerate(self._pos_ids) if i not in self._dead]
        vecs = self._hnsw.reconstruct_n(0, len(self._pos_ids))[keep] if keep else np.zeros((0, self.dim), np.float32)
        return np.array([self._pos_ids[p] for p in keep], dtype=np.int64), vecs

    def _to_hnsw(self) -> None:
        ids, vecs = self._live()
        self._new_hnsw(ids, vecs)

    def _new_hnsw(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        index = faiss.IndexHNSWFlat(self.dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        index.hnsw.efSearch = HNSW_EF_SEARCH
        index.add(np.ascontiguousarray(vecs, dtype=np.float32))
        self._flat = None
        self._hnsw = index
        self._pos_ids = ids.tolist()
        self._id_pos = {i: p for p, i in enumerate(self._pos_ids)}
        self._dead = set()

    def _rebuild(self) -> None:
        ids, vecs = self._live()
        if len(ids) <= self.hnsw_threshold // 2:
            self._hnsw = None
            self._pos_ids, self._id_pos, self._dead = [], {}, set()
            self._flat = faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
            if len(ids):
                self._flat.add_with_ids(vecs, ids)
        else:
            self._new_hnsw(ids, vecs)
