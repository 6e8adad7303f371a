"""The runner's part in speculative decoding's sampling: choosing a draft model's (or head's)
tokens, and verifying a window of drafts drawn from the draft distribution by rejection
sampling (spec/rejection.py)."""

from __future__ import annotations

import torch

from dolmus.runtime.batch_inputs import RunnerSequence, sampling_row
from dolmus.runtime.sampler import Sampler, SamplingRow
from dolmus.spec.rejection import rejection_sample


class DraftSampling:
    """Chooses drafts, keeping this step's draft distributions (`probs`, per request: one q row
    per sampled draft) until the target's rows verify them."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.probs: dict[str, list[torch.Tensor]] = {}

    def choose(self, logits: torch.Tensor, requests: list[tuple[str, RunnerSequence]]) -> list[int]:
        """The draft model's tokens, one per (request, sequence whose tokens end before it).

        Greedy for greedy and seeded requests: deterministic drafts verified against the
        target's own draws, whose noise is keyed by output position, give a seeded request the
        same tokens however its windows fall (they depend on timings and the other requests).
        Drawn from the draft model's distribution for the rest, which is kept for rejection
        sampling: more drafts are accepted than the greedy guess gets."""
        greedy = logits.max(dim=-1).indices.tolist()
        out = []
        for i, (rid, seq) in enumerate(requests):
            if seq.params.greedy or seq.seed is not None:
                out.append(greedy[i])
                continue
            row = sampling_row(seq, None)
            q = self.sampler.probabilities(logits[i : i + 1], [row])
            _, noise = self.sampler.noise(seq.seed, [row.num_output_tokens], q.shape[1], ":draft")
            out.append(int((q / noise).argmax()))
            self.probs.setdefault(rid, []).append(q[0])
        return out

    def verify(
        self,
        seq: RunnerSequence,
        drafts: list[int],
        q: list[torch.Tensor],
        logits: torch.Tensor,
        rows: list[SamplingRow],
    ) -> tuple[list[int], list | None]:
        """One window of sampled drafts: the tokens it emits, and their logprobs if asked."""
        p = self.sampler.probabilities(logits, rows)
        first = rows[0].num_output_tokens
        positions = list(range(first, first + len(rows)))
        uniforms, noise = self.sampler.noise(seq.seed, positions, p.shape[1], ":verify")
        emitted, count = rejection_sample(
            torch.tensor([drafts]),
            torch.stack(q).unsqueeze(0),
            p.unsqueeze(0),
            uniforms[:-1].unsqueeze(0),
            noise.unsqueeze(0),
        )
        kept = emitted[0, : int(count[0])].tolist()
        k = seq.params.logprobs
        if k is None:
            return kept, None
        raw = torch.log_softmax(logits.float(), dim=-1)
        return kept, [Sampler.with_logprobs(t, raw[i], k).logprobs for i, t in enumerate(kept)]
