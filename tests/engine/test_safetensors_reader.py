"""engine/safetensors_reader.py against safetensors' own loader: the same tensors (names, dtypes, shapes, bytes) from
single and sharded files, whatever the segment and piece sizes, and a clear error for a broken file."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.safetensors_reader import iter_safetensors, plan_segments, read_header


def _random_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "a.f32": torch.randn(37, 5, generator=g),
        "b.bf16": torch.randn(300, generator=g).to(torch.bfloat16),
        "c.f16": torch.randn(3, 7, 11, generator=g).to(torch.float16),
        "d.i64": torch.randint(-10**12, 10**12, (9,), generator=g),
        "e.i8": torch.randint(-128, 128, (1001,), generator=g, dtype=torch.int8),
        "f.u8": torch.randint(0, 256, (13, 3), generator=g, dtype=torch.uint8),
        "g.bool": torch.rand(17, generator=g) > 0.5,
        "h.fp8": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
        "i.scalar": torch.tensor(3.5),
        "j.empty": torch.empty(0, 4),
        "k.big": torch.randn(4096, generator=g),
    }
    return out


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("segment_bytes,piece_bytes,threads", [(1 << 20, 1 << 20, 1), (4096, 1000, 3), (64, 7, 2)])
def test_the_reader_gives_the_tensors_load_file_gives(tmp_path, segment_bytes, piece_bytes, threads):
    file = str(tmp_path / "model.safetensors")
    save_file(_random_tensors(0), file, metadata={"format": "pt"})
    got = dict(iter_safetensors([file], None, "cpu", segment_bytes, piece_bytes, threads))
    _assert_same(got, load_file(file))


def test_a_sharded_checkpoint_reads_whole_and_a_name_filter_keeps_only_its_names(tmp_path):
    shards = [str(tmp_path / f"model-0000{i}-of-00002.safetensors") for i in (1, 2)]
    save_file(_random_tensors(1), shards[0])
    save_file({f"second.{k}": v for k, v in _random_tensors(2).items()}, shards[1])
    expected = {**load_file(shards[0]), **load_file(shards[1])}
    _assert_same(dict(iter_safetensors(shards, None, "cpu", 2048, 512)), expected)
    wanted = {shards[0]: {"a.f32", "k.big"}, shards[1]: {"second.g.bool"}}
    got = dict(iter_safetensors(shards, wanted, "cpu", 2048, 512))
    _assert_same(got, {n: expected[n] for n in ("a.f32", "k.big", "second.g.bool")})


def test_a_tensor_at_an_unaligned_offset_still_reads_right(tmp_path):
    """safetensors' writer keeps tensors aligned; another writer may not: a float32 right after 3 bytes."""
    values = torch.tensor([1.5, -2.25, 3.0, 1e-8])
    header = {"odd": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "after": {"dtype": "F32", "shape": [4], "data_offsets": [3, 19]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    file = tmp_path / "odd.safetensors"
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes([7, 8, 9]) + values.numpy().tobytes())
    got = dict(iter_safetensors([str(file)], None, "cpu", 64, 5))
    assert got["odd"].tolist() == [7, 8, 9] and torch.equal(got["after"], values)


def test_segments_group_consecutive_tensors_and_a_large_one_stands_alone(tmp_path):
    file = str(tmp_path / "m.safetensors")
    save_file({"small1": torch.zeros(10), "large": torch.zeros(1000), "small2": torch.zeros(10)}, file)
    segments = plan_segments(file, read_header(file), segment_bytes=1024)
    assert [sorted(e.name for e in s.entries) for s in segments] in (
        [["large"], ["small1", "small2"]], [["small1", "small2"], ["large"]],
        [["large"], ["small1"], ["small2"]], [["small1"], ["large"], ["small2"]])
    assert all(s.start % 16 == 0 for s in segments)


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_broken_file_is_a_value_error_naming_it(tmp_path, damage):
    file = tmp_path / "broken.safetensors"
    save_file({"w": torch.randn(100)}, str(file))
    data = file.read_bytes()
    file.write_bytes(data[:-40] if damage == "truncated" else data[:8] + b"{not json" + data[17:])
    with pytest.raises(ValueError, match="broken.safetensors"):
        list(iter_safetensors([str(file)]))
