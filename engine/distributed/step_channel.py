"""Rank 0 sends each step's host inputs to the other ranks over the gloo group: a fixed-size message that holds
the header and, when it fits, the int64 payload (else a second message carries it); when the step reads pending
input tokens, it then broadcasts the previous step's sampled tokens over the device group, unless every rank
picked those tokens itself (greedy steps). Every rank then runs the same forward pass on its shard of the model."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from engine.batch_inputs import HostInputs, packed_sections
from engine.distributed.parallel_state import TensorParallel

_STOP = -1
_HEADER = 8
_MESSAGE = 512  # int64 words of the first message: the header, and the payload when it fits (decode steps)


def send_step(tp: TensorParallel, host: HostInputs | None) -> None:
    """`None` tells the other ranks to leave their step loop. One broadcast when the step's payload fits the first
    message beside its header, else a second one for the payload: each is host work on every rank, every step."""
    message = torch.zeros(_MESSAGE, dtype=torch.int64)
    if host is None:
        message[1] = _STOP
        dist.broadcast(message, src=0, group=tp.cpu_group)
        return
    header = [host.num_tokens, host.num_seqs, host.block_tables.shape[1], host.max_query_len, host.max_seq_len,
              len(host.logits_indices), host.num_previous_rows, int(host.greedy_tokens)]
    payload = np.concatenate([host.packed, host.block_tables.astype(np.int64).ravel(),
                              np.asarray(host.logits_indices, dtype=np.int64)])
    words = message.numpy()
    words[:_HEADER] = header
    inline = _HEADER + payload.size <= _MESSAGE
    if inline:
        words[_HEADER: _HEADER + payload.size] = payload
    dist.broadcast(message, src=0, group=tp.cpu_group)
    if not inline:
        dist.broadcast(torch.from_numpy(payload), src=0, group=tp.cpu_group)


def receive_step(tp: TensorParallel) -> HostInputs | None:
    message = torch.empty(_MESSAGE, dtype=torch.int64)
    dist.broadcast(message, src=0, group=tp.cpu_group)
    num_tokens, num_seqs, max_blocks, max_query_len, max_seq_len, num_logits, num_previous, greedy = (
        message[:_HEADER].tolist())
    if num_seqs == _STOP:
        return None
    packed_len = sum(packed_sections(num_tokens, num_seqs))
    size = packed_len + num_seqs * max_blocks + num_logits
    if _HEADER + size <= _MESSAGE:
        data = message.numpy()[_HEADER: _HEADER + size]
    else:
        payload = torch.empty(size, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=tp.cpu_group)
        data = payload.numpy()
    tables = data[packed_len: packed_len + num_seqs * max_blocks].astype(np.int32).reshape(num_seqs, max_blocks)
    return HostInputs(
        packed=data[:packed_len],
        block_tables=tables,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        logits_indices=data[packed_len + num_seqs * max_blocks:].tolist(),
        num_previous_rows=num_previous,
        greedy_tokens=bool(greedy),
    )


def share_previous_tokens(tp: TensorParallel, host: HostInputs, token_ids: torch.Tensor | None,
                          device: torch.device, picked_here: torch.Tensor | None = None) -> torch.Tensor | None:
    """Rank 0's previous sampled tokens on every rank, when this step reads pending inputs from them. When the
    previous step picked its greedy tokens on every rank (`picked_here`, which every rank holds or none does),
    each rank reads its own copy and nothing is sent."""
    if not host.num_previous_rows:
        return token_ids
    if picked_here is not None:
        if picked_here.shape[0] != host.num_previous_rows:
            raise RuntimeError(f"the previous step picked {picked_here.shape[0]} tokens on this rank, "
                               f"this step reads {host.num_previous_rows}")
        return token_ids if tp.is_driver else picked_here
    if not tp.is_driver:
        token_ids = torch.empty(host.num_previous_rows, dtype=torch.int64, device=device)
    dist.broadcast(token_ids, src=0, group=tp.device_group)
    return token_ids
