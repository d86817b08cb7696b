"""Embed every QQP sentence once and keep the vectors in a file under /tmp (CPU is scarce)."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tollgate import envs  # noqa: E402

DATA = envs.get("TOLLGATE_DATA_DIR")
CACHE_DIR = envs.get("TOLLGATE_EMB_CACHE")


def embed_texts(texts: list[str], tag: str, tuned: bool = True) -> np.ndarray:
    """Vectors for `texts`, computed once per distinct list and stored as .npy under CACHE_DIR. `tuned`: with the
    shipped fine-tuning (cache/embedder_lora.npz), else all-MiniLM-L6-v2 as published."""
    from cache.lora import DEFAULT_LORA

    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    if not tuned:
        digest += "-base"
    elif DEFAULT_LORA.exists():  # vectors depend on the shipped fine-tuning too
        digest += "-" + hashlib.sha256(DEFAULT_LORA.read_bytes()).hexdigest()[:8]
    path = CACHE_DIR / f"{tag}-{digest}.npy"
    if path.exists():
        return np.load(path)
    from cache.embedder import Embedder

    emb = Embedder(envs.get("TOLLGATE_MINILM_DIR"), device=envs.get("TOLLGATE_EMB_DEVICE"), lora=tuned)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    out = np.zeros((len(texts), emb.dim), dtype=np.float32)
    step = 4096
    start = time.time()
    for i in range(0, len(texts), step):
        out[i : i + step] = emb.encode(texts[i : i + step], batch_size=128)
        print(f"{tag}: {i + step}/{len(texts)} in {time.time() - start:.0f}s", flush=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, out)
    os.replace(tmp, path)
    return out


def qqp_sentences() -> list[str]:
    pairs = json.loads((DATA / "qqp_pairs.json").read_text())
    return sorted({p["text_a"] for p in pairs} | {p["text_b"] for p in pairs})


if __name__ == "__main__":
    embed_texts(qqp_sentences(), "qqp")
