"""Linear and embedding layers, whole or split across a tensor-parallel group.

Column-parallel layers hold a slice of the output features (no communication: their output stays
split); row-parallel layers hold a slice of the input features and sum their partial products with
one all-reduce. The vocabulary-parallel embedding and LM head split the vocabulary rows. Each layer
knows how to cut its slice out of a full checkpoint tensor (`shard_of`)."""

from __future__ import annotations

import torch
from torch import nn

import kernels as ops
from engine.distributed.parallel_state import SINGLE, TensorParallel


class Linear(nn.Module):
    """y = x W^T (+ b) on this rank's weights, with no communication."""

    shard_dim: int | None = None  # the dimension of a checkpoint tensor this layer keeps a slice of

    def __init__(self, in_features: int, out_features: int, bias: bool, device, dtype,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor, *, norm: ops.Norm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """linear(rms_norm(x, *norm)) + residual, each part where given (kernels.linear)."""
        return ops.linear(x, self.weight, self.bias, norm=norm, residual=residual)

    def forward_silu_and_mul(self, x: torch.Tensor, *, norm: ops.Norm | None = None) -> torch.Tensor:
        return ops.linear_silu_and_mul(x, self.weight, self.bias, norm=norm)

    def shard_of(self, tensor: torch.Tensor, is_bias: bool = False) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor (of one fused part, for fused layers)."""
        return shard_tensor(tensor, self.shard_dim, self.tp, is_bias)


def shard_tensor(tensor: torch.Tensor, dim: int | None, tp: TensorParallel, is_bias: bool = False) -> torch.Tensor:
    """tp.rank's slice along dim (0: column-parallel, 1: row-parallel, whose bias every rank keeps whole)."""
    if dim is None or tp.size == 1 or (is_bias and dim == 1):
        return tensor
    size = tensor.shape[dim] // tp.size
    return tensor.narrow(dim, tp.rank * size, size)


class ColumnParallelLinear(Linear):
    """Keeps out_features / tp of the outputs; `out_features` here is the full (unsplit) width."""

    shard_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool, device, dtype,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(in_features, tp.shard_size(out_features, "output features"), bias, device, dtype, tp)


class RowParallelLinear(Linear):
    """Keeps in_features / tp of the inputs and all-reduces the partial outputs; the bias is added once."""

    shard_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool, device, dtype,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(tp.shard_size(in_features, "input features"), out_features, bias, device, dtype, tp)

    def forward(self, x: torch.Tensor, *, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.tp.size == 1:
            return ops.linear(x, self.weight, self.bias, residual=residual)
        out = self.tp.all_reduce(self.forward_partial(x))
        out = out if self.bias is None else out + self.bias
        return out if residual is None else out + residual

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output: before the all-reduce and the bias."""
        return ops.linear(x, self.weight)


def row_parallel_add_rms_norm(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm(layer(x), residual, weight, eps); a bias-free row-parallel layer under tensor parallelism hands
    its partial output to the group, which can run the all-reduce, the add and the norm as one kernel."""
    forward_partial = getattr(layer, "forward_partial", None)
    if forward_partial is None or layer.bias is not None:
        return ops.add_rms_norm(layer(x), residual, weight, eps)
    return layer.tp.all_reduce_add_rms_norm(forward_partial(x), residual, weight, eps)


def gate_up_silu(layer: nn.Module, x: torch.Tensor, norm: ops.Norm | None = None) -> torch.Tensor:
    """silu(gate) * up of a fused gate_up projection (of rms_norm(x, *norm) with a norm); layers with a fused kernel
    for it (`forward_silu_and_mul`: the decode GEMVs apply it in their epilogue) run that."""
    fused = getattr(layer, "forward_silu_and_mul", None)
    return fused(x, norm=norm) if fused is not None else ops.silu_and_mul(layer(x, norm=norm))


def fuses_norms(tp: TensorParallel, num_tokens: int) -> bool:
    """Whether a step leaves each RMSNorm to the projection after it and each residual add to the one before it:
    one token on one rank, where the projections are decode GEMVs that fuse them (kernels/gemv_rows.py; one whose
    fused form measured slower runs a separate norm kernel first) and the step saves most of its norm kernels.
    Batched steps keep the one-kernel add + norm, which the GEMMs cannot fuse."""
    return tp.size == 1 and num_tokens == 1


def padded_vocab_size(vocab_size: int, tp: TensorParallel) -> int:
    """Rounded up so every rank holds the same number of rows; the padding rows are never real tokens."""
    return -(-vocab_size // tp.size) * tp.size


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous block of vocabulary rows; ids outside it contribute zeros to the sum."""

    def __init__(self, vocab_size: int, hidden_size: int, device, dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = padded_vocab_size(vocab_size, tp) // tp.size
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size, device=device, dtype=dtype),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.forward_partial(ids))

    def forward_partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the embeddings, zeros where another rank holds the id."""
        return ops.shard_embedding(ids, self.weight, self.start)

    def forward_rms_norm(self, ids: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(embeddings, weight, eps), embeddings) for the first layer; under tensor parallelism the all-reduce
        runs with the norm."""
        partial = self.forward_partial(ids)
        if self.tp.size == 1:
            return ops.rms_norm(partial, weight, eps), partial
        rows = partial.view(-1, partial.shape[-1])
        h, embeddings = self.tp.all_reduce_rms_norm(rows, weight, eps)
        return h.view(partial.shape), embeddings.view(partial.shape)

    def shard_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full [vocab, hidden] tensor, zero rows past the real vocabulary."""
        part = tensor[self.start: self.start + self.rows]
        if part.shape[0] == self.rows:
            return part
        pad = part.new_zeros(self.rows - part.shape[0], part.shape[1])
        return torch.cat([part, pad])


def vocab_parallel_logits(partial: torch.Tensor, embedding: VocabParallelEmbedding) -> torch.Tensor:
    """The logits of this rank's vocabulary rows [N, vocab / tp], gathered from all ranks into [N, vocab] float32."""
    logits = embedding.tp.all_gather_last_dim(partial)
    return logits[..., : embedding.vocab_size].float()


def vocab_parallel_argmax(partial: torch.Tensor, embedding: VocabParallelEmbedding) -> torch.Tensor:
    """Each row's argmax over the whole vocabulary [N] int64, from this rank's logits [N, vocab / tp], on every
    rank: each rank takes the largest logit of each 4096-column chunk of its shard with that logit's index, the
    ranks exchange those few pairs a row instead of every logit, and each picks the first index of the largest,
    the token ops.argmax would pick from the gathered logits."""
    real = max(0, min(embedding.rows, embedding.vocab_size - embedding.start))  # the last rank may hold padding
    return embedding.tp.argmax_over_shards(partial[:, :real], embedding.start, embedding.rows)
