"""What the sampler does to a batch's float32 logits before it draws: penalties, top-k, top-p.

Each works on all the rows that need it at once. A row at a time cost ~10 small tensor ops a
row (penalties: ~0.15 ms a row on a 49k vocabulary), and a full sort of every row for top-k or
top-p cost ~2 ms a row there (68 ms for 32 rows on 2 cores), while the rows' candidates are a
few hundred tokens at most: `torch.topk` of those is ~50x cheaper, and a row whose nucleus
does not fit in them still goes through the sort. On a GPU every row is sorted (one kernel,
and no host sync, which the split would need).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from dolmus.sampling_params import SamplingParams

# How many of a row's likeliest tokens top-k/top-p looks at before sorting the whole row:
# a nucleus of p = 0.95 of a trained chat model's distribution mostly lies in its top few
# dozen tokens; a row whose nucleus (or top-k) is wider is sorted whole.
TRUNCATION_CANDIDATES = 256


def apply_penalties(
    logits: torch.Tensor,
    indices: Sequence[int],
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> None:
    """In place on rows `indices` of `logits` [rows, vocab]: the repetition penalty over every
    token seen (prompt and output, as transformers and vLLM), then frequency and presence
    penalties over the output's tokens (OpenAI's definition). Ids outside the vocabulary are
    ignored."""
    device = logits.device
    vocab = logits.shape[-1]
    at = torch.tensor(list(indices), device=device)
    rows = logits[at]
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        seen = _token_counts(token_ids, vocab, device) > 0
        factor = torch.tensor(repetition, dtype=rows.dtype, device=device).unsqueeze(1)
        rows = torch.where(seen, torch.where(rows > 0, rows / factor, rows * factor), rows)
    frequency = [p.frequency_penalty for p in params]
    presence = [p.presence_penalty for p in params]
    if any(frequency) or any(presence):
        counts = _token_counts(output_ids, vocab, device).to(rows.dtype)
        f = torch.tensor(frequency, dtype=rows.dtype, device=device).unsqueeze(1)
        pr = torch.tensor(presence, dtype=rows.dtype, device=device).unsqueeze(1)
        rows = rows - (f * counts + pr * (counts > 0).to(rows.dtype))
    logits[at] = rows


def _token_counts(id_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(id_lists), vocab] int64: how often each token appears in each list."""
    n = len(id_lists)
    flat = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.long, device=device)
    lengths = torch.tensor([len(ids) for ids in id_lists], device=device)
    row = torch.repeat_interleave(torch.arange(n, device=device), lengths)
    inside = (flat >= 0) & (flat < vocab)
    return torch.bincount((row * vocab + flat)[inside], minlength=n * vocab).view(n, vocab)


def top_k_top_p(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """Each row's logits with all but its top-k tokens, then all outside its top-p nucleus (of
    the distribution renormalised over the top k), set to -inf; the likeliest token always
    stays. The kept sets are those of transformers' TopKLogitsWarper then TopPLogitsWarper:
    ties at the k-th value are all kept, and a token stays while the mass of the tokens above
    it is under p."""
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if logits.device.type != "cpu":
        # One sort on the device, with no host sync (async scheduling samples without one);
        # the candidates' split below needs to know on the host which rows spill.
        return _sorted_top_k_top_p(logits, ks, list(top_p))
    truncated = [i for i, (k, p) in enumerate(zip(ks, top_p)) if k < vocab or p < 1.0]
    out = logits.clone()
    if not truncated:
        return out
    width = min(vocab, max([TRUNCATION_CANDIDATES] + [ks[i] + 1 for i in truncated if ks[i] < vocab]))
    rows = logits[truncated]
    values, ids = rows.topk(width, dim=-1)  # sorted, likeliest first
    k = torch.tensor([ks[i] for i in truncated], device=logits.device)
    p = torch.tensor([top_p[i] for i in truncated], dtype=logits.dtype, device=logits.device).unsqueeze(1)
    with_k = k < vocab
    kth = values.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
    kth = torch.where(with_k.unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
    kept_values = values.masked_fill(values < kth, float("-inf"))
    # The renormalised distribution: over the top k where there is one (all of it among the
    # candidates), else over the whole row.
    norm = torch.where(
        with_k.unsqueeze(1), kept_values.logsumexp(-1, keepdim=True), rows.logsumexp(-1, keepdim=True)
    )
    probs = (kept_values - norm).exp()
    above = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each
    keep = (above < p) | (p >= 1.0)
    keep[:, 0] = True
    kept_values = kept_values.masked_fill(~keep, float("-inf"))
    # Rows whose kept set may reach past the candidates: a tie at the k-th value running to
    # the last candidate, or (without top-k) a nucleus the candidates' mass does not cover.
    if width < vocab:
        spill = (with_k & (values[:, -1] >= kth[:, 0])) | (~with_k & (probs.sum(-1) < p[:, 0]))
    else:
        spill = torch.zeros_like(with_k)
    fast = (~spill).nonzero().flatten()
    at = torch.tensor(truncated, device=logits.device)
    out[at[fast]] = torch.full_like(rows[fast], float("-inf")).scatter_(1, ids[fast], kept_values[fast])
    slow = spill.nonzero().flatten().tolist()
    if slow:
        whole = [truncated[j] for j in slow]
        out[whole] = _sorted_top_k_top_p(logits[whole], [ks[i] for i in whole], [top_p[i] for i in whole])
    return out


def _sorted_top_k_top_p(logits: torch.Tensor, ks: list[int], top_p: list[float]) -> torch.Tensor:
    """top_k_top_p over whole sorted rows (ks already in 1..vocab)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    k = torch.tensor(ks, device=logits.device)
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    p = torch.tensor(top_p, device=logits.device).unsqueeze(1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cum <= 1 - p
    outside[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)
