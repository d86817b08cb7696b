"""Finds a model (directory, .gguf file, pkg:<package>, random:<name>) and loads its config, weights and tokenizer."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from safetensors import safe_open

from engine.model_config import ModelConfig, parameter_shapes, token_id_tuple
from engine.quantization.checkpoint import CheckpointQuantization, checkpoint_shapes, parse_quantization_config
from engine.safetensors_reader import iter_safetensors
from engine.random_models import random_model_config, random_weights
from engine.tokenizer import Tokenizer

_RANDOM_PREFIX = "random:"
_TOKENIZER_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tollgate-tokenizer")
_PACKAGE_PREFIX = "pkg:"
_INDEX_FILE = "model.safetensors.index.json"
# Buffers some checkpoints carry that are not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Tensors of AWQ / GPTQ checkpoints, kept in their stored dtype (packed ints, fp16 scales repacked exactly).
_QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


class LoadedModel:
    """A model's config, its weights (an iterator that reads them as it goes) and its tokenizer, which may still
    be loading in a thread while the weights are read: reading `tokenizer` waits for it.

    A load that fails leaves no thread behind: weights that fail to read wait for the tokenizer thread before
    the error propagates, and so does leaving a `with` block on any error (a caller's own failure while it
    builds the model)."""

    def __init__(self, config: ModelConfig, weights: Iterator[tuple[str, torch.Tensor]],
                 tokenizer: Tokenizer | None | Future, source: str,
                 quantization: CheckpointQuantization | None = None) -> None:
        self.config = config
        self.weights = self._settling_on_error(weights)
        self._tokenizer = tokenizer
        self.source = source
        self.quantization = quantization  # an AWQ / GPTQ checkpoint's own

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.settle()

    def settle(self) -> None:
        """Waits until the tokenizer thread is done (its result or error stays for `tokenizer` to give)."""
        _settle(self._tokenizer)

    def _settling_on_error(self, weights: Iterator[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            yield from weights
        except Exception:
            self.settle()
            raise

    @property
    def tokenizer(self) -> Tokenizer | None:
        if isinstance(self._tokenizer, Future):
            self._tokenizer = self._tokenizer.result()
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer


def resolve_model_source(source: str) -> str:
    if not isinstance(source, str) or not source:
        raise ValueError(f"model source: expected a non-empty string, got {source!r}")
    if source.startswith(_RANDOM_PREFIX):
        random_model_config(source[len(_RANDOM_PREFIX):])
        return source
    if source.startswith(_PACKAGE_PREFIX):
        return _resolve_package(source[len(_PACKAGE_PREFIX):])
    path = os.path.abspath(os.path.expanduser(source))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{path}: model directory has no config.json")
        return path
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: not a model directory or a .gguf file")
        return path
    raise ValueError(f"{path}: no such model directory or file")


def load_model(source: str, device: torch.device | str, dtype: torch.dtype,
               tokenizer_source: str | None = None, load_tokenizer: bool = True) -> LoadedModel:
    """The tokenizer loads in a thread of its own while the caller reads the weights; without load_tokenizer
    (a model loaded again, whose tokenizer the caller has) it is None."""
    resolved = resolve_model_source(source)
    tokenizer_path = resolve_tokenizer_source(tokenizer_source) if tokenizer_source else None
    tokenizer: Tokenizer | None | Future = None
    if load_tokenizer:
        tokenizer = _TOKENIZER_THREAD.submit(_tokenizer, resolved, tokenizer_path, tokenizer_source)
    quantization = None
    try:
        if resolved.startswith(_RANDOM_PREFIX):
            config = random_model_config(resolved[len(_RANDOM_PREFIX):])
            weights = random_weights(config, device, dtype)
        elif os.path.isdir(resolved):
            config, weights, quantization = _load_directory(resolved, device, dtype)
        else:
            from engine.gguf_loader import load_gguf

            config, weights = load_gguf(resolved, device, dtype)
    except BaseException:
        _settle(tokenizer)
        raise
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=resolved,
                       quantization=quantization)


def _settle(tokenizer: Tokenizer | None | Future) -> None:
    if isinstance(tokenizer, Future):
        wait([tokenizer])


def load_tokenizer(source: str, tokenizer_source: str | None = None) -> Tokenizer | None:
    """The tokenizer load_model would give the model, without its weights (a serving front tokenizes itself)."""
    return _tokenizer(resolve_model_source(source),
                      resolve_tokenizer_source(tokenizer_source) if tokenizer_source else None, tokenizer_source)


def _tokenizer(resolved: str, tokenizer_path: str | None, tokenizer_source: str | None) -> Tokenizer | None:
    if tokenizer_path is None and not resolved.startswith(_RANDOM_PREFIX):
        tokenizer_path = resolved
    tokenizer = Tokenizer.from_source(tokenizer_path) if tokenizer_path else None
    if tokenizer_source and tokenizer is None:
        raise ValueError(f"tokenizer: {tokenizer_source} holds no tokenizer")
    return tokenizer


def resolve_tokenizer_source(source: str) -> str:
    """A tokenizer comes from anything a model does, or from a directory that holds only a tokenizer (such as one
    saved with save_pretrained, to run a random model with a real vocabulary)."""
    path = os.path.abspath(os.path.expanduser(source)) if isinstance(source, str) else ""
    if path and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        return path
    return resolve_model_source(source)


def read_model_config(source: str) -> ModelConfig:
    """The model's config without its weights: the checks a deploy makes before any replica starts (the
    source exists, its config parses, an AWQ / GPTQ quantization_config is one the engine loads)."""
    resolved = resolve_model_source(source)
    if resolved.startswith(_RANDOM_PREFIX):
        return random_model_config(resolved[len(_RANDOM_PREFIX):])
    if os.path.isdir(resolved):
        data = _read_json(os.path.join(resolved, "config.json"), "config")
        raw_quantization = data.get("quantization_config") if isinstance(data, dict) else None
        if raw_quantization is not None:
            parse_quantization_config(raw_quantization)
        config = _model_config(resolved, data)
        _safetensors_files(resolved)
        return config
    from engine.gguf_loader import gguf_model_config, open_gguf

    reader = open_gguf(resolved)
    return gguf_model_config(reader, {t.name: t for t in reader.tensors}, resolved)


def _resolve_package(package: str) -> str:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError) as e:
        raise ValueError(f"pkg:{package}: cannot find the package: {e}") from e
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ValueError(f"pkg:{package}: no installed package of that name holds a model")
    folder = locations[0]
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(folder, ggufs[0])
    if len(ggufs) > 1:
        raise ValueError(f"pkg:{package}: {folder} holds several .gguf files {ggufs}; name one")
    for entry in sorted(os.listdir(folder)):
        if os.path.isfile(os.path.join(folder, entry, "config.json")):
            return os.path.join(folder, entry)
    raise ValueError(f"pkg:{package}: {folder} holds no config.json model directory or .gguf file")


def _load_directory(path: str, device: torch.device | str, dtype: torch.dtype
                    ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]], CheckpointQuantization | None]:
    """The config, the weights and, for an AWQ / GPTQ checkpoint, its quantization_config, from one read of
    config.json."""
    data = _read_json(os.path.join(path, "config.json"), "config")
    raw_quantization = data.get("quantization_config") if isinstance(data, dict) else None
    quantization = None if raw_quantization is None else parse_quantization_config(raw_quantization)
    config = _model_config(path, data)
    files = _safetensors_files(path)
    names_by_file: dict[str, list[str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                names = [n for n in f.keys() if not n.endswith(_IGNORED_SUFFIXES)]
                for name in names:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own SafetensorError on a corrupt header
            raise ValueError(f"{file}: not a readable safetensors file: {e}") from e
        if config.tie_word_embeddings:
            names = [n for n in names if n != "lm_head.weight"]
        names_by_file[file] = names
    expected = parameter_shapes(config) if quantization is None else checkpoint_shapes(config, quantization)
    for name, shape in expected.items():
        if name not in shapes:
            raise ValueError(f"{path}: checkpoint lacks tensor {name}")
        if shapes[name] != shape:
            raise ValueError(f"{path}: tensor {name} has shape {shapes[name]}, the config expects {shape}")
    return config, _iter_safetensors(names_by_file, device, dtype), quantization


def _iter_safetensors(names_by_file: dict[str, list[str]], device: torch.device | str, dtype: torch.dtype
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in file order, read in large chunks (engine/safetensors_reader.py)."""
    files = list(names_by_file)
    try:
        for name, tensor in iter_safetensors(files, {f: set(n) for f, n in names_by_file.items()}, device):
            yield name, tensor if name.endswith(_QUANTIZED_SUFFIXES) else tensor.to(dtype)
    except OSError as e:
        raise ValueError(f"{e.filename or files[0]}: cannot read tensors: {e}") from e


def _read_json(file: str, what: str) -> Any:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: unreadable {what}: {e}") from e


def _model_config(path: str, data: Any) -> ModelConfig:
    file = os.path.join(path, "config.json")
    try:
        config = ModelConfig.from_hf_dict(data)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from e
    extra_eos = _generation_eos_ids(path)
    if extra_eos:
        merged = config.eos_token_ids + tuple(i for i in extra_eos if i not in config.eos_token_ids)
        config = dataclasses.replace(config, eos_token_ids=merged)
    return config


def _generation_eos_ids(path: str) -> tuple[int, ...]:
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return ()
    data = _read_json(file, "generation config")
    try:
        return token_id_tuple(data.get("eos_token_id")) if isinstance(data, dict) else ()
    except ValueError as e:
        raise ValueError(f"{file}: unreadable generation config: {e}") from e


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, _INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: unreadable shard index: {e}") from e
        files = [os.path.join(path, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{missing[0]}: shard named in {index} is missing")
        return files
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights in the model directory")
    return files
