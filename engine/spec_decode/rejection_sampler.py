"""Checks draft tokens against the target model so that the tokens kept are distributed exactly as if the
target had sampled them one at a time (Leviathan et al. 2023; Chen et al. 2023).

Draft token i is kept with probability min(1, p_i(d_i) / q_i(d_i)), p being the target's processed
distribution (temperature, top-k, top-p, min-p: what the normal sampler draws from) and q the draft's. At
the first rejection the target's token comes from norm(max(0, p_i - q_i)); when every draft is kept, a
bonus token comes from p_k. A deterministic proposal (n-gram lookup) has a one-hot q. Greedy rows keep the
drafts that equal the target's argmax and end with the argmax, which is what plain greedy decoding gives."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.config import SamplingParams
from engine.sampler import processed_probs, sample_from_probs


def _uniforms(generators: Sequence[torch.Generator | None], lengths: Sequence[int], width: int,
              device: torch.device) -> torch.Tensor:
    """[N, width] draws of U[0, 1): a seeded row's first lengths[i] from its own generator, the rest in one draw."""
    u = torch.rand(len(generators), width, device=device)
    for i, (generator, n) in enumerate(zip(generators, lengths)):
        if generator is not None:
            u[i, :n] = torch.rand(n, generator=generator, device=device)
    return u


def rejection_sample(
    target_logits: torch.Tensor,
    row_starts: Sequence[int],
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[list[int]]:
    """For each sequence s with k_s >= 1 drafts, target_logits rows row_starts[s] .. row_starts[s] + k_s are the
    target's logits after its last token and after each draft. draft_probs[s] is the draft's [k_s, V]
    distribution, or None for a deterministic proposal. Returns per sequence the tokens to append:
    the kept drafts, then one token of the target's."""
    device, vocab = target_logits.device, target_logits.shape[-1]
    num_seqs = len(row_starts)
    lengths = [len(d) for d in draft_token_ids]
    width = max(lengths)
    lengths_t = torch.tensor(lengths)
    steps = torch.arange(width + 1)
    # row j of sequence s; padding repeats its last row
    index = torch.tensor(list(row_starts)).unsqueeze(1) + torch.minimum(steps.unsqueeze(0), lengths_t.unsqueeze(1))
    logits = target_logits[index.to(device)].float()  # [S, K + 1, V]
    drafts = torch.tensor([list(t) + [0] * (width - len(t)) for t in draft_token_ids], device=device)
    is_draft = (steps[:width].unsqueeze(0) < lengths_t.unsqueeze(1)).to(device)  # [S, K]

    num_kept = torch.zeros(num_seqs, dtype=torch.long, device=device)
    last = torch.zeros(num_seqs, dtype=torch.long, device=device)
    greedy = [i for i, sp in enumerate(params) if sp.temperature == 0.0]
    if greedy:
        rows = torch.tensor(greedy, device=device)
        best = logits[rows].argmax(dim=-1)  # [G, K + 1]
        agree = (best[:, :width] == drafts[rows]) & is_draft[rows]
        kept = agree.long().cumprod(dim=1).sum(dim=1)
        num_kept[rows] = kept
        last[rows] = best.gather(1, kept.unsqueeze(1)).squeeze(1)

    sampled = [i for i, sp in enumerate(params) if sp.temperature != 0.0]
    if sampled:
        rows = torch.tensor(sampled, device=device)
        n = len(sampled)
        row_params = [params[s] for s in sampled for _ in range(width + 1)]
        p = processed_probs(logits[rows].reshape(-1, vocab), row_params).view(n, width + 1, vocab)
        d = drafts[rows]
        p_of_draft = p[:, :width].gather(2, d.unsqueeze(2)).squeeze(2)  # [n, K]
        q: torch.Tensor | None = None
        given = [draft_probs[s] for s in sampled]
        if all(g is not None and g.shape[0] == width for g in given):
            q = torch.stack([g for g in given if g is not None]).to(device=device, dtype=torch.float32)
        elif any(g is not None for g in given):
            q = F.one_hot(d, vocab).float()
            for r, (s, g) in enumerate(zip(sampled, given)):
                if g is not None:
                    q[r, : lengths[s]] = g[: lengths[s]].to(device=device, dtype=torch.float32)
        if q is not None:
            q_of_draft = q.gather(2, d.unsqueeze(2)).squeeze(2)
        else:
            q_of_draft = torch.ones_like(p_of_draft)
        u = _uniforms([generators[s] for s in sampled], [lengths[s] for s in sampled], width, device)
        accept = (u * q_of_draft < p_of_draft) & is_draft[rows]  # u < p / q, q > 0 for anything the draft proposed
        kept = accept.long().cumprod(dim=1).sum(dim=1)
        arange = torch.arange(n, device=device)
        p_next = p[arange, kept]  # [n, V]
        at = kept.clamp(max=width - 1)
        q_next = q[arange, at] if q is not None else F.one_hot(d[arange, at], vocab).float()
        residual = (p_next - q_next).clamp_min(0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        # a rejection leaves p > q somewhere; mass 0 is rounding, where p itself is the answer
        rejected = (kept < lengths_t[sampled].to(device)).unsqueeze(1) & (mass > 0)
        dist = torch.where(rejected, residual / mass.clamp_min(torch.finfo(torch.float32).tiny), p_next)
        num_kept[rows] = kept
        last[rows] = sample_from_probs(dist, [generators[s] for s in sampled])

    kept_list, last_list = num_kept.tolist(), last.tolist()
    return [list(draft_token_ids[s][: kept_list[s]]) + [last_list[s]] for s in range(num_seqs)]
