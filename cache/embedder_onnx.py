"""The embedder's encoder, mean pooling and normalisation exported once to ONNX and run by ONNX Runtime.

On one CPU thread this embeds a prompt ~2.3x faster than the same float32 model in PyTorch (bench/cache.py,
BENCHMARKS.md), with embeddings equal to ~1e-7: PyTorch spends three quarters of that time in the encoder's matrix
products at a prompt's few rows, which ONNX Runtime's kernels do faster. The export happens the first time a model
(with its fine-tuning deltas) is loaded and is kept beside the extracted model, named by a digest of the weight
file and the deltas."""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import numpy as np

from tollgate import envs

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OPSET = 17


def available() -> bool:
    """Whether ONNX Runtime and the exporter's `onnx` package are installed."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def export_path(model_dir: Path, lora_path: Path | None) -> Path:
    """Where the export of this model with these deltas lives: named by a digest of the weight file's size and time
    and of the deltas' bytes."""
    weights = (model_dir / "model.safetensors").stat()
    digest = hashlib.sha256(f"{weights.st_size}:{weights.st_mtime_ns}".encode())
    if lora_path is not None:
        digest.update(lora_path.read_bytes())
    return model_dir.parent / "onnx" / f"{model_dir.name}-{digest.hexdigest()[:16]}-opset{OPSET}.onnx"


def export(bert, path: Path) -> None:
    """Writes bert (a transformers BertModel in float32, deltas applied) + mean pooling + L2 normalisation to
    path, atomically: concurrent exporters each write a private file and the last rename wins."""
    import torch

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            tokens = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                               token_type_ids=token_type_ids).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            mean = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, dim=-1)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    example = tuple(torch.ones(1, 4, dtype=torch.int64) for _ in INPUTS)
    axes = {name: {0: "batch", 1: "tokens"} for name in INPUTS}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on shape-dependent branches the export fixes
        torch.onnx.export(Pooled().eval(), example, str(tmp), input_names=list(INPUTS), output_names=["embedding"],
                          dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    os.replace(tmp, path)


def remove_other_exports(path: Path) -> None:
    """Deletes the exports of the same model with other deltas or opsets (~90 MB each), left by earlier fine-tunings.
    A process still running one has read it already."""
    model_name = path.name.rsplit("-", 2)[0]  # export_path's names: model-digest-opsetN.onnx
    for other in path.parent.glob(f"{model_name}-*.onnx"):
        if other != path and other.name.rsplit("-", 2)[0] == model_name:
            other.unlink(missing_ok=True)


def default_threads() -> int:
    """TOLLGATE_EMBEDDER_THREADS, else two where the host has two cores or more."""
    value = envs.get("TOLLGATE_EMBEDDER_THREADS")
    if value is None:
        return min(2, os.cpu_count() or 1)
    if value < 1:
        raise ValueError(f"TOLLGATE_EMBEDDER_THREADS: a whole number >= 1 expected, got {value!r}")
    return int(value)


def _other_runnable_tasks() -> int | None:
    """Threads on the host ready to run now besides the caller (/proc/loadavg's running count), or None off Linux."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        return None


class OnnxEncoder:
    """Tokenized batches (INPUTS as int64 arrays) -> unit-norm float32 embeddings [batch, dim].

    With `threads` > 1 a prompt runs on that many threads while the host has as many cores free at that moment, and
    on one thread otherwise: a thread that has to wait for a busy core stalls each of the encoder's parallel sections
    (on this 2-core box with one core busy, two threads took 6.3 ms at p50 against 3.4 ms on one; on an idle host
    they take 2.3). The parallel session's threads stop spinning after each call, so they do not count as busy at the
    next one. Its weights are a second copy (~90 MB)."""

    def __init__(self, path: Path, threads: int | None = None) -> None:
        self.threads = default_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads: >= 1 expected, got {self.threads}")
        self._single = _session(path, 1)
        self._parallel = _session(path, self.threads) if self.threads > 1 else None
        self.parallel_calls = 0

    def _pick(self):
        if self._parallel is None:
            return self._single
        others = _other_runnable_tasks()
        if others is None or others > (os.cpu_count() or 1) - self.threads:
            return self._single
        self.parallel_calls += 1
        return self._parallel

    def __call__(self, features: dict) -> np.ndarray:
        feeds = {name: np.asarray(features[name], dtype=np.int64) for name in INPUTS}
        return self._pick().run(None, feeds)[0]


def _session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if threads > 1:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
