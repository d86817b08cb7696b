"""Converted checkpoints for fast replica starts. Loading a GGUF file means parsing its metadata
(seconds for a 49k-token vocabulary) and dequantising every tensor; a replica that starts from zero
pays that on every cold start. The first load writes the same model as an HF directory (float32
safetensors, config.json, tokenizer files) under the cache folder, keyed by the file's path, size and
mtime; later replicas on that node load the directory, which the engine reads in a fraction of the time.
Other sources (directories, random:) are used as they are."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from tollgate import envs

log = logging.getLogger("tollgate.model_cache")

_FORMAT = "1"  # bump when the layout of a converted directory changes


def cache_root() -> Path:
    return envs.model_cache_dir() / "checkpoints"


def prepared_source(source: str) -> str:
    """The source to give the engine: a converted directory for a GGUF file, else `source` itself."""
    from engine.loader import resolve_model_source

    resolved = resolve_model_source(source)
    if not (os.path.isfile(resolved) and resolved.endswith(".gguf")):
        return source
    stat = os.stat(resolved)
    key = hashlib.sha256(f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}|{_FORMAT}".encode()).hexdigest()[:24]
    target = cache_root() / key
    if (target / "model.safetensors").is_file():
        return str(target)
    try:
        _convert(resolved, target)
    except OSError as e:  # a read-only or full cache folder only costs speed
        log.warning("could not cache a converted checkpoint of %s: %s", resolved, e)
        return source
    return str(target)


def _convert(gguf_path: str, target: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from engine.gguf_loader import load_gguf
    from engine.tokenizer import Tokenizer

    config, weights = load_gguf(gguf_path, "cpu", torch.float32)
    tensors = {name: t.contiguous() for name, t in weights}
    tokenizer = Tokenizer.from_source(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"))
        hf_config = config.to_hf_dict()
        (staging / "config.json").write_text(json.dumps(hf_config, indent=1))
        (staging / "generation_config.json").write_text(json.dumps({"eos_token_id": list(config.eos_token_ids)}))
        if tokenizer is not None:
            tokenizer.hf.save_pretrained(str(staging))
        os.replace(staging, target)  # atomic: a reader sees the whole folder or none
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if (target / "model.safetensors").is_file():  # another replica finished first
            return
        raise
