"""Verification of drafts that were sampled from a draft distribution q (a draft model's).

Standard speculative sampling (Leviathan et al., Chen et al.): draft i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)), where p_i is the distribution the target would draw
position i from; the first rejected position draws instead from the residual
max(p_i - q_i, 0), renormalised, and a window whose drafts are all accepted ends with a
plain draw from p_{k+1}. Each emitted token is then exactly a draw from the target, whatever
q is, and a draft model close to the target gets most drafts accepted also when sampling
(deterministic drafts of the likeliest token are accepted only with p_i(d_i)).

Draws use exponential noise (argmax of probs / E, as the sampler does) and uniforms given by
the caller, so a seeded request's noise can be keyed by its seed and output positions.
"""

from __future__ import annotations

import torch


def rejection_sample(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of B requests with k drafts each.

    drafts [B, k] int64; draft_probs [B, k, V] (q, each draft drawn from its row);
    target_probs [B, k + 1, V] (p, the last row for the token after the last draft);
    uniforms [B, k] in [0, 1); noise [B, k + 1, V] Exp(1). Returns the emitted tokens
    [B, k + 1] and how many of each row are emitted ([B], 1 to k + 1): the accepted drafts,
    then the residual's or the bonus position's draw.
    """
    batch, k = drafts.shape
    p_draft = target_probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)
    q_draft = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
    accepted = uniforms * q_draft < p_draft  # u < p / q, without dividing by a zero q
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    residual = (target_probs[:, :k] - draft_probs).clamp_min(0)
    # Where p <= q everywhere (p == q up to rounding) no draft is ever rejected; the
    # residual is then never read, and p keeps the argmax defined.
    empty = residual.sum(dim=2, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[:, :k], residual)
    replacement = (residual / noise[:, :k]).argmax(dim=2)  # [B, k]
    bonus = (target_probs[:, k] / noise[:, k]).argmax(dim=1, keepdim=True)  # [B, 1]
    last = torch.cat((replacement, bonus), dim=1)  # the draw at each possible stopping point
    emitted = torch.cat((drafts, torch.zeros(batch, 1, dtype=drafts.dtype, device=drafts.device)), dim=1)
    stop = num_accepted.unsqueeze(1)
    emitted.scatter_(1, stop, last.gather(1, stop))
    return emitted, num_accepted + 1
