"""Medusa speculative decoding in the runner: the heads (models/medusa.py) and the one hidden
state per request they read.

After every step that samples for a request, the target's final hidden state at the row that
gave the request's last emitted token (the bonus or replacement draw, or the last accepted
draft's successor) is kept in a persistent buffer, one row per block-table row: the state at
position n - 1, whose LM head gave token n. In a step that drafts, head j of that state
guesses the token at n + 1 + j, so k drafts cost one pass of k small heads and nothing else:
no KV of their own, no catch-up, no pass over the drafts. The chain is a single path (top-1
per head for greedy and seeded requests); Medusa's tree attention over several candidates
per head is not done here.

Drafts are picked by the runner's `choose` like a draft model's: greedy where the request is
greedy or seeded (checked against the target's own draws, spec/verify.py), drawn from the
head's distribution otherwise and verified by rejection sampling (spec/rejection.py); a head
predicts its offset whatever the drafts before it are, so its distribution is a valid draft
distribution for every position of the chain and the target's distribution is kept exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from dolmus.runtime.draft_model import Choose
from dolmus.runtime.models.medusa import MedusaHeads


class MedusaDrafter:
    def __init__(self, heads: MedusaHeads, rows: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.heads = heads
        # block-table row -> the target's final hidden state at its request's last kept position
        self.hidden = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.position: dict[str, int] = {}  # request id -> that position

    def forget(self, request_id: str) -> None:
        self.position.pop(request_id, None)

    def keep(self, kept: list[tuple[str, Any, int]], hidden: torch.Tensor) -> None:
        """The target's hidden states after a step: (request id, its sequence, the flat row of
        the hidden state that gave its last emitted token). Each sequence's tokens end with that
        token, so the state sits at the position before it."""
        if not kept:
            return
        rows = torch.tensor([seq.row for _, seq, _ in kept], device=self.hidden.device)
        at = torch.tensor([r for *_, r in kept], device=hidden.device)
        self.hidden.index_copy_(0, rows, hidden.index_select(0, at).to(self.hidden.dtype))
        for rid, seq, _ in kept:
            self.position[rid] = len(seq.token_ids) - 2

    def propose(self, requests: list[tuple[str, Any, int]], choose: Choose) -> dict[str, list[int]]:
        """`room` drafts for each (request id, sequence, room); each sequence's tokens end with
        the one the target computes first this step, at its num_computed_tokens."""
        drafts: dict[str, list[int]] = {}
        live = []
        for rid, seq, room in requests:
            if self.position.get(rid) != seq.num_computed_tokens - 1:
                # no state for its last position (its KV came from elsewhere): a guess the
                # target will turn down, so the scheduled window keeps its size
                drafts[rid] = [seq.token_ids[-1]] * room
            else:
                drafts[rid] = []
                live.append((rid, seq, room))
        if not live:
            return drafts
        rows = torch.tensor([seq.row for _, seq, _ in live], device=self.hidden.device)
        logits = self.heads(self.hidden.index_select(0, rows), max(room for *_, room in live))
        for j in range(logits.shape[0]):
            going = [i for i, (_, _, room) in enumerate(live) if room > j]
            picked = logits[j] if len(going) == len(live) else logits[j, going]
            # each draft is picked after the drafts before it (penalties, position-keyed noise)
            tokens = choose(picked, [(live[i][0], live[i][1]) for i in going])
            for i, token in zip(going, tokens):
                rid, seq, room = live[i]
                drafts[rid].append(token)
                if len(drafts[rid]) < room:
                    seq.token_ids.append(token)
        for _, seq, room in live:  # the caller appends the drafts itself
            if room > 1:
                del seq.token_ids[-(room - 1) :]
        return drafts
