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


class OnnxEncoder:
    """Tokenized batches (INPUTS as int64 arrays) -> unit-norm float32 embeddings [batch, dim]. One thread: a prompt
    is too small to split, and on a busy host a second thread waits for a core (as torch's did, cache/embedder.py)."""

    def __init__(self, path: Path, threads: int = 1) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, threads)
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, features: dict) -> np.ndarray:
        feeds = {name: np.asarray(features[name], dtype=np.int64) for name in INPUTS}
        return self._session.run(None, feeds)[0]
