"""Turns one step's logits into next tokens: penalties, temperature, top-k / top-p / min-p,
reproducible seeded sampling and logprobs, all vectorised over the batch."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import torch

import kernels as ops
from engine.config import SamplingParams
from engine.outputs import TokenLogprob
from engine.transfer import to_device

if TYPE_CHECKING:
    from engine.token_mask import TokenBitmask

__all__ = ["SamplingRow", "SamplerOutput", "Sampler", "add_logit_bias", "apply_penalties", "processed_probs",
           "sample_from_probs", "suppress_tokens"]

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One sequence to sample for in this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated before this step
    # Set when params.seed is not None; the caller creates it once per sequence on the logits'
    # device and keeps it across steps.
    generator: torch.Generator | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # One entry per row when any row asked for logprobs (None for the rows that did not), else None.
    logprobs: list[TokenLogprob | None] | None


def suppress_tokens(logits: torch.Tensor, rows_to_token_ids: dict[int, Collection[int]]) -> None:
    """Sets logits[row, token] to -inf in place for every given row and token id."""
    row_index: list[int] = []
    col_index: list[int] = []
    for row, token_ids in rows_to_token_ids.items():
        row_index.extend([row] * len(token_ids))
        col_index.extend(token_ids)
    if not row_index:
        return
    device = logits.device
    index = (to_device(row_index, torch.int64, device), to_device(col_index, torch.int64, device))
    # a device tensor of -inf: a Python scalar would be copied to the GPU synchronously
    logits.index_put_(index, torch.full((len(row_index),), _NEG_INF, dtype=logits.dtype, device=device))


def add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """New float32 logits with each row's logit_bias added (OpenAI's logit_bias); the input is left untouched."""
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for row, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(row)
            cols.append(token_id)
            biases.append(float(bias))
    out = logits.to(torch.float32, copy=True)
    if rows:
        device = out.device
        out.index_put_((to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)),
                       to_device(biases, torch.float32, device), accumulate=True)
    return out


def _uses_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def _plain_greedy(params: SamplingParams) -> bool:
    """The row's token is the argmax of its logits as they are, and no logprobs are asked of them."""
    return (params.temperature == 0.0 and not params.logit_bias and not _uses_penalties(params)
            and params.logprobs is None)


def _per_row(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device)


def _token_counts(sequences: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32: how many times each token id occurs in each row's sequence."""
    counts = torch.zeros(len(sequences), vocab_size, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    if int(lengths.sum()) == 0:
        return counts
    rows = to_device(torch.repeat_interleave(torch.arange(len(sequences)), lengths), torch.int64, device)
    cols = to_device(list(chain.from_iterable(sequences)), torch.int64, device)
    counts.index_put_((rows, cols), torch.ones_like(cols, dtype=torch.float32), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Returns new float32 logits with each row's penalties applied; the input is left untouched.

    Repetition penalty first (HF/CTRL, over prompt and output tokens), then OpenAI's
    logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty with c counting output tokens only.
    """
    out = logits.to(torch.float32, copy=True)
    params = [r.params for r in rows]
    if not any(_uses_penalties(p) for p in params):
        return out
    device, vocab_size = out.device, out.shape[-1]
    output_counts = _token_counts([r.output_token_ids for r in rows], vocab_size, device)
    output_seen = output_counts > 0

    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_seen = _token_counts([r.prompt_token_ids for r in rows], vocab_size, device) > 0
        penalty = _per_row([p.repetition_penalty for p in params], device).unsqueeze(1)
        penalised = torch.where(out > 0, out / penalty, out * penalty)
        out = torch.where(prompt_seen | output_seen, penalised, out)

    frequency = _per_row([p.frequency_penalty for p in params], device).unsqueeze(1)
    presence = _per_row([p.presence_penalty for p in params], device).unsqueeze(1)
    return out - output_counts * frequency - output_seen.to(torch.float32) * presence


def _filter_support(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Masks to -inf every token outside the top-k, then top-p, then min-p support of its row."""
    device, vocab_size = logits.device, logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    # top_p == 1 keeps everything; comparing rounded cumulative sums against 1.0 could drop tail tokens.
    top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]

    if any(k < vocab_size for k in top_k) or any(p != float("inf") for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab_size, device=device).unsqueeze(0)
        k_tensor = to_device(top_k, torch.int64, device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(rank >= k_tensor, _NEG_INF)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # 0 at rank 0: the best token always stays
        sorted_logits = sorted_logits.masked_fill(mass_before >= _per_row(top_p, device).unsqueeze(1), _NEG_INF)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)

    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * _per_row([p.min_p for p in params], device).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    return logits


def _exponential_noise(generators: Sequence[torch.Generator | None], vocab_size: int,
                       device: torch.device) -> torch.Tensor:
    """[N, V] draws of Exp(1): a seeded row's from its own generator, the others in one batched draw."""
    noise = torch.empty(len(generators), vocab_size, dtype=torch.float32, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    elif unseeded:
        noise[to_device(unseeded, torch.int64, device)] = torch.empty(
            len(unseeded), vocab_size, dtype=torch.float32, device=device).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax would pick.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a row is sampled from: temperature, then top-k / top-p / min-p. Rows need temperature > 0."""
    temperature = _per_row([p.temperature for p in params], logits.device).unsqueeze(1)
    return _filter_support(logits / temperature, params).softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs, each seeded row drawn from its own generator."""
    # Exponential race: argmax(p / q) with q ~ Exp(1) picks token j with probability p[j].
    noise = _exponential_noise(generators, probs.shape[-1], probs.device)
    return ops.argmax(probs / noise)


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Samples one token per row of float32 logits; every row here has temperature > 0."""
    probs = processed_probs(logits, [r.params for r in rows])
    return sample_from_probs(probs, [r.generator for r in rows])


def _logprobs(raw_logits: torch.Tensor, token_ids: list[int], params: Sequence[SamplingParams]
              ) -> list[TokenLogprob | None]:
    """Logprobs of the raw (unpenalised, untempered) distribution for the rows that asked."""
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    device, vocab_size = raw_logits.device, raw_logits.shape[-1]
    index = torch.tensor(wanted, device=device)
    logprobs = torch.log_softmax(raw_logits[index].to(torch.float32), dim=-1)
    chosen_ids = torch.tensor([token_ids[i] for i in wanted], dtype=torch.int64, device=device)
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    k = min(max(params[i].logprobs or 0 for i in wanted), vocab_size)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()

    out: list[TokenLogprob | None] = [None] * len(params)
    for j, i in enumerate(wanted):
        n = min(params[i].logprobs or 0, vocab_size)
        top = list(zip(top_ids_list[j][:n], top_values_list[j][:n]))
        out[i] = TokenLogprob(token_id=token_ids[i], logprob=chosen[j], top=top)
    return out


class Sampler:
    def token_tensor(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                     bitmask: TokenBitmask | None = None) -> torch.Tensor:
        """One token id per row, left on the logits' device (nothing waits for the GPU). `bitmask`: the structured
        outputs' masks of some rows, applied to the logits in place first (so the logprobs of those rows are over
        the tokens their grammar allows); where every row is plain greedy, one masked argmax instead, which leaves
        the logits as they are."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits: expected shape [{len(rows)}, V], got {tuple(logits.shape)}")
        params = [r.params for r in rows]
        if bitmask is not None and all(_plain_greedy(p) for p in params):
            return ops.masked_argmax(logits, bitmask.words, bitmask.mask_of_row)  # nothing reads the logits after
        if bitmask is not None:
            ops.apply_token_bitmask_(logits, bitmask.words, bitmask.rows)
        if any(p.logit_bias for p in params):
            logits = add_logit_bias(logits, params)  # a copy: the logprobs stay those of the raw distribution
        if any(_uses_penalties(p) for p in params):
            adjusted = apply_penalties(logits, rows)
        else:
            adjusted = logits  # greedy rows take the argmax as it is; sampled rows are cast to float32

        sampled = [i for i, p in enumerate(params) if p.temperature != 0.0]
        if len(sampled) == len(rows):
            return _sample(adjusted.float(), rows)
        tokens = ops.argmax(adjusted)
        if sampled:
            index = to_device(sampled, torch.int64, logits.device)
            tokens[index] = _sample(adjusted[index].float(), [rows[i] for i in sampled])
        return tokens

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 bitmask: TokenBitmask | None = None) -> SamplerOutput:
        token_ids: list[int] = self.token_tensor(logits, rows, bitmask).tolist()
        params = [r.params for r in rows]
        wants_logprobs = any(p.logprobs is not None for p in params)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=_logprobs(logits, token_ids, params) if wants_logprobs else None,
        )
