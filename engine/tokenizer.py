"""A thin typed wrapper over a transformers tokenizer: encode, decode, specials, chat template."""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from engine.model_config import token_id_tuple
from engine.tool_prompt import fallback_messages, template_has_tool_section, uses_tools
from engine.vocab_bytes import VocabularyBytes, vocabulary_encoding
from tollgate import envs

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self._hf = hf_tokenizer
        eos = set(int(i) for i in eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self._backend = _backend_tokenizer(hf_tokenizer)  # the Rust tokenizer when decoding straight through it
        self._byte_view: Any = None  # llguidance's view, which knows each token's bytes (built on first use)
        self._vocabulary_bytes: VocabularyBytes | None | bool = None  # the common encodings' bytes without it
        self._byte_view_lock = threading.Lock()

    @classmethod
    def from_source(cls, path: str) -> Tokenizer | None:
        """The tokenizer of a model directory or a .gguf file; None for a directory without one."""
        if os.path.isfile(path) and path.endswith(".gguf"):
            return cls._from_gguf(path)
        if os.path.isdir(path):
            if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
                return None
            from transformers import AutoTokenizer

            try:
                hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except Exception as e:
                raise ValueError(f"{path}: cannot load the tokenizer: {e}") from e
            return cls(hf, _directory_eos_ids(path))
        raise ValueError(f"{path}: no such model directory or .gguf file for a tokenizer")

    @classmethod
    def _from_gguf(cls, path: str) -> Tokenizer | None:
        stat = os.stat(path)
        return _gguf_tokenizer(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)

    @property
    def hf(self) -> Any:
        return self._hf

    @property
    def vocab_size(self) -> int:
        return len(self._hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: expected a string, got {type(text).__name__}")
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces: it would make the decode of a sequence differ from the sum of its parts.
        if self._backend is not None:
            return self._backend.decode(list(token_ids), skip_special_tokens)
        return self._hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=False)

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int | list[int]], str | None] | None:
        """A streaming decoder of one output's tokens where the Rust tokenizer decodes straight: each call takes
        the next id (or ids) and returns the text they complete (None while they end inside a character or add
        nothing), the pieces adding up to decode() of all of them; one Rust call a token. None: decode windows
        (engine/detokenizer.py). Older tokenizers take one id a call: a list raises there, and the detokenizer goes
        on with windows."""
        if self._backend is None:
            return None
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # tokenizers before 0.21
            return None
        return functools.partial(DecodeStream(skip_special_tokens=skip_special_tokens).step, self._backend)

    def token_bytes(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        """The tokens' own bytes: a token holding part of a character gives that part, where decode() gives U+FFFD.
        A special token gives its text; an id past the vocabulary nothing. Read off the vocabulary for byte-level and
        byte-fallback tokenizers (engine/vocab_bytes.py); any other token, or tokenizer, has the first call build
        llguidance's view of the vocabulary (0.3 s for 49k tokens), which gives nothing for a token beginning with byte
        0xFF (it marks special tokens with it); a tokenizer it cannot read gives decode()'s text as UTF-8."""
        vocabulary_bytes = self._vocabulary_reader()
        if vocabulary_bytes is not None:
            read = vocabulary_bytes(token_ids)
            if read is not None:
                return read
        view = self._bytes_view()
        if view is None:
            return self.decode(token_ids, skip_special_tokens).encode("utf-8")
        size = self.vocab_size
        ids = [t for t in token_ids if 0 <= t < size and not (skip_special_tokens and view.is_special_token(t))]
        return view.decode_bytes(ids) if ids else b""

    @property
    def knows_token_bytes(self) -> bool:
        """Whether token_bytes() is ready without building llguidance's view first (for an added or special token a
        byte-level or byte-fallback tokenizer still builds it)."""
        return self._vocabulary_reader() is not None or self._byte_view is not None

    def _vocabulary_reader(self) -> VocabularyBytes | None:
        if self._vocabulary_bytes is None:
            encoding = vocabulary_encoding(self._hf)
            self._vocabulary_bytes = VocabularyBytes(self._hf, encoding) if encoding else False
        return self._vocabulary_bytes or None

    def _bytes_view(self) -> Any:
        if self._byte_view is None:
            with self._byte_view_lock:
                if self._byte_view is None:
                    self._byte_view = _llguidance_view(self._hf, min(self.eos_token_ids, default=0)) or False
        return self._byte_view or None

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self._hf.convert_ids_to_tokens(list(ids)))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The rendered prompt; `tools` (OpenAI's function tools) go through the template's own tool section, or the
        fallback format of engine/tool_prompt.py when it has none."""
        _check_messages(messages)
        template = getattr(self._hf, "chat_template", None)
        if not template:
            raise ValueError("chat_template: this tokenizer has no chat template")
        messages = with_speaker_names(messages, self._hf.chat_template)
        extra: dict[str, Any] = {}
        if uses_tools(messages, tools):
            if template_has_tool_section(template):
                extra["tools"] = tools or None
            else:
                messages = fallback_messages(messages, tools)
        try:
            return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                **extra)
        except Exception as e:  # jinja2 errors, including the template's own raise_exception(...)
            raise ValueError(f"messages: the chat template rejected them: {e}") from e


def _llguidance_view(hf_tokenizer: Any, eos_token_id: int) -> Any:
    try:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos_token_id)
    except Exception:  # a slow (Python) tokenizer, or one llguidance cannot parse
        return None


def _backend_tokenizer(hf_tokenizer: Any) -> Any:
    """The Rust tokenizer, to decode with straight where transformers' decode adds nothing to it (a fast tokenizer
    whose class keeps the base _decode) but the conversions around it, which were most of a large batch's host time
    per step (docs/benchmarks/engine.md, 2026-12-06). None: use the wrapper."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as base
    except ImportError:  # transformers 4
        from transformers import PreTrainedTokenizerFast as base
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(hf_tokenizer, base) or type(hf_tokenizer)._decode is not base._decode:
        return None
    return backend


@functools.lru_cache(maxsize=1)
def _gguf_tokenizer(path: str, mtime_ns: int, size: int) -> Tokenizer | None:
    """Built once per file and process: converting GGUF vocabularies and merges takes seconds."""
    from transformers import AutoTokenizer

    from engine.gguf_loader import gguf_eos_token_ids, open_gguf

    reader = open_gguf(path)
    if "tokenizer.ggml.tokens" not in reader.fields:
        return None
    saved = _converted_tokenizer_dir(path, mtime_ns, size)
    if os.path.isfile(os.path.join(saved, "tokenizer.json")):
        hf = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    else:
        try:
            hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                               local_files_only=True)
        except Exception as e:
            raise ValueError(f"{path}: cannot build a tokenizer from the GGUF metadata: {e}") from e
        _save_converted(hf, saved)
    return Tokenizer(hf, gguf_eos_token_ids(reader))


def _converted_tokenizer_dir(path: str, mtime_ns: int, size: int) -> str:
    """Where the tokenizer converted from a GGUF file is kept, so later loads skip the conversion."""
    import hashlib

    import transformers

    key = hashlib.sha256(f"{path}|{mtime_ns}|{size}|{transformers.__version__}".encode()).hexdigest()[:24]
    return str(envs.model_cache_dir() / "tokenizers" / key)


def _save_converted(hf: Any, target: str) -> None:
    import shutil
    import tempfile

    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(dir=parent)
    except OSError:
        return  # a read-only cache folder only costs speed
    try:
        hf.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a reader sees the whole folder or none
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


# a template that reads a message's `name` (message.name, message['name'], also as msg / m)
_READS_NAME = re.compile(r"\b(?:message|msg|m)\s*(?:\.\s*name\b|\[\s*['\"]name['\"]\s*\])")


def with_speaker_names(messages: list[dict], template: str) -> list[dict]:
    """OpenAI's `name` of a message (who speaks, among several of one role): left to a template that reads it, else
    written before the content as "name: content", so that it is never silently dropped."""
    if not any(m.get("name") for m in messages) or _READS_NAME.search(template):
        return messages
    return [{**m, "content": f"{m['name']}: {m['content']}"} if m.get("name") else m for m in messages]


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]: expected a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{i}].{key}: expected a string, got {message.get(key)!r}")


def _directory_eos_ids(path: str) -> tuple[int, ...]:
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
            if isinstance(data, dict):
                ids.extend(token_id_tuple(data.get("eos_token_id")))
        except (OSError, ValueError) as e:
            raise ValueError(f"{file}: unreadable: {e}") from e
    return tuple(ids)


def encode_prompt(tokenizer: Tokenizer | None, vocab_size: int,
                  prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
    """A prompt's text (None for token ids) and token ids; a ValueError naming `prompt` when it cannot run."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        bos = tokenizer.bos_token_id
        if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
            ids = ids[1:]  # the text (e.g. a rendered chat template) already began with BOS
        return prompt, ids
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt: must not be empty")
    bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
    if bad is not None or not all(isinstance(t, int) for t in ids):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size}); got {bad!r}")
    return None, ids
