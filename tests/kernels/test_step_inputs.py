"""A staged decode step unpacked by a CUDA graph's first kernel (kernels/step_inputs.py) against the PyTorch
reference and against the eager path's device_inputs: pending tokens read from the previous step's tokens at the
address in the header, padding rows, block tables narrower than the graph's, several tokens a sequence (verify
steps), and bad buffers."""

import numpy as np
import pytest
import torch

from engine.batch_inputs import HostInputs, device_inputs, graph_staging
from kernels import reference

pytest.importorskip("triton")
from kernels.step_inputs import unpack_step_inputs  # noqa: E402

MAX_BS, MAX_BLOCKS = 8, 12


def _host(n: int, q: int, width: int, rng: np.random.Generator) -> HostInputs:
    t = n * q
    ids = rng.integers(0, 1000, t)
    rows = np.where(rng.random(t) < 0.5, rng.integers(0, 5, t), -1)  # about half the tokens pending
    packed = np.concatenate([ids, rng.integers(0, 4000, t), rng.integers(0, 9000, t), rows,
                             rng.integers(q, 4000, n), np.arange(n + 1) * q]).astype(np.int64)
    return HostInputs(packed=packed, block_tables=rng.integers(0, 500, (n, width), dtype=np.int32), num_tokens=t,
                      num_seqs=n, max_query_len=q, max_seq_len=4000, logits_indices=list(range(t)),
                      num_previous_rows=5 if (rows >= 0).any() else 0)


def _statics(q: int, device: torch.device) -> list[torch.Tensor]:
    """The graph's static inputs, filled with values no step writes."""
    return [torch.full((MAX_BS * q,), 777, dtype=torch.long, device=device) for _ in range(3)] + [
        torch.full((MAX_BS,), 777, dtype=torch.int32, device=device),
        torch.full((MAX_BS, MAX_BLOCKS), 777, dtype=torch.int32, device=device)]


@pytest.mark.parametrize(("n", "q", "width", "bs"), [(1, 1, 3, 1), (3, 1, 12, 4), (5, 5, 7, 8), (0, 1, 0, 2)])
def test_unpacked_as_the_reference_and_the_eager_path(device: torch.device, n: int, q: int, width: int,
                                                      bs: int) -> None:
    rng = np.random.default_rng(n * 100 + q * 10 + width)
    host = _host(n, q, width, rng)
    previous = torch.from_numpy(rng.integers(1000, 2000, 5)).to(device)
    staged = graph_staging(host, previous, pin_memory=False)
    staging = torch.zeros(4096, dtype=torch.int64, device=device)
    staging.view(torch.uint8)[: staged.numel()] = staged.to(device)
    got, want = _statics(q, device), _statics(q, device)
    unpack_step_inputs(staging, *got, bs, q)
    reference.unpack_step_inputs(staging, previous, *want, bs, q)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    ids, positions, slots, seq_lens, tables = got
    t = n * q
    eager = device_inputs(host, device, previous)
    assert torch.equal(ids[:t], eager.input_ids) and torch.equal(positions[:t], eager.positions)
    assert torch.equal(slots[:t], eager.meta.slot_mapping) and torch.equal(seq_lens[:n], eager.meta.seq_lens)
    assert torch.equal(tables[:n, :width], eager.meta.block_tables)
    assert (slots[t: bs * q] == -1).all() and (seq_lens[n:bs] == q).all()  # padding rows
    assert (ids[bs * q:] == 777).all() and (tables[:n, width:] == 777).all() and (tables[n:] == 777).all()


def test_no_pending_tokens_leave_the_address_zero(device: torch.device) -> None:
    host = _host(2, 1, 2, np.random.default_rng(1))
    host.packed[3 * 2: 4 * 2] = -1
    host.num_previous_rows = 0
    staged = graph_staging(host, torch.zeros(3, dtype=torch.long), pin_memory=False).view(torch.int64)
    assert staged[:4].tolist() == [2, 2, 0, 0]
    staging = torch.zeros(256, dtype=torch.int64, device=device)
    staging[: staged.numel()] = staged.to(device)
    ids, *rest = _statics(1, device)
    unpack_step_inputs(staging, ids, *rest, 2, 1)
    assert ids[:2].tolist() == host.packed[:2].tolist()


def test_pending_tokens_without_the_previous_step_are_refused() -> None:
    host = _host(3, 1, 2, np.random.default_rng(2))
    assert host.num_previous_rows
    for previous in (None, torch.zeros(2, dtype=torch.long)):
        with pytest.raises(RuntimeError, match="previous tokens"):
            graph_staging(host, previous, pin_memory=False)


def test_bad_buffers_are_rejected(device: torch.device) -> None:
    ids, positions, slots, seq_lens, tables = _statics(1, device)
    with pytest.raises(ValueError, match="staging"):
        unpack_step_inputs(torch.zeros(64, dtype=torch.int32, device=device), ids, positions, slots, seq_lens, tables,
                           1, 1)
    with pytest.raises(ValueError, match="int32"):
        unpack_step_inputs(torch.zeros(64, dtype=torch.int64, device=device), ids, positions, slots, seq_lens.long(),
                           tables, 1, 1)
