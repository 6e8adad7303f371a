"""A small model of the same tokenizer that drafts a request's next tokens for the target.

It lives beside the target in the runner, with a KV cache of its own laid out in the same
blocks (the same block ids address both pools, so the scheduler's block tables serve both).
It runs on every step of the target that has a prefill chunk (writing the prompt's draft
KV as the target writes its own); in a step that drafts it catches up on the tokens it has
not seen (the last window's accepted drafts and bonus token, the steps without drafts since),
then runs one single-token step per further draft;
the target then verifies the window. For a greedy request the drafts are the draft model's
greedy choices, checked against the target's own (spec/verify.py); for a sampled one they
are drawn from the draft model's distribution and verified by rejection sampling
(spec/rejection.py), which keeps the target's distribution and accepts more of them.

Its KV is trusted only as far as the tokens it was computed from are the request's: after a
window, up to the last accepted draft. A block shared through the prefix cache may hold
another request's target KV but never had draft KV written for this request, so a request
new to the runner is caught up from its first token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dolmus.config import ModelConfig
from dolmus.runtime.attention import AttentionMetadata
from dolmus.runtime.attention.kv_store import PagedKV, kv_bytes_per_token, make_kv_store

# Catch-ups of up to this many tokens per request go through the fused step as single rows.
_ROWS_PER_CATCH_UP = 8

# (sequence, context before the entry's tokens, how many tokens) -> ids, positions, metadata
Prepare = Callable[[list[tuple[Any, int, int]], int], tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]
# rows of (sequence, context before its one token) -> final hidden states, by a fused step
FusedRun = Callable[[Any, list[tuple[Any, int]]], torch.Tensor]
# logits of the draft model after each (request id, sequence) -> its draft tokens
Choose = Callable[[torch.Tensor, list[tuple[str, Any]]], list[int]]


class DraftModel:
    """The draft model, its KV pool, and how far each request's draft KV is good."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig) -> None:
        self.model = model
        self.config = config
        self.kv_caches: list[PagedKV] = []
        self.fused_decoder: Any = None
        self.computed: dict[str, int] = {}  # request id -> tokens whose draft KV is good

    def kv_bytes_per_token(self, kv_cache_dtype: str, dtype: torch.dtype) -> int:
        heads, width, value_dim = self.config.kv_layout()
        latent = value_dim is not None
        return self.config.num_layers * kv_bytes_per_token(kv_cache_dtype, heads, width, dtype, latent)

    def allocate(
        self, kv_cache_dtype: str, slots: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        heads, width, value_dim = self.config.kv_layout()
        self.kv_caches = [
            make_kv_store(kv_cache_dtype, slots, heads, width, block_size, dtype, device, value_dim)
            for _ in range(self.config.num_layers)
        ]

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)

    def checked(self, request_id: str, num_computed_tokens: int) -> None:
        """The target kept the request's tokens up to `num_computed_tokens` (its KV is good
        there): the draft's KV past them was computed from rejected drafts."""
        if request_id in self.computed:
            self.computed[request_id] = min(self.computed[request_id], num_computed_tokens)

    def follow(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        spans: list[tuple[str, int, int]],
    ) -> None:
        """Run the draft model on the target's step as laid out (prefill chunks and decodes;
        spans: request id, context before its tokens, how many), so a prompt's draft KV is
        written while the target prefills it, not in a later step that drafts."""
        no_rows = torch.empty(0, dtype=torch.long, device=input_ids.device)  # only its KV is kept
        self.model(input_ids, positions, self.kv_caches, meta, no_rows)
        for rid, start, n in spans:
            if self.computed.get(rid, 0) >= start:  # contiguous with what it has
                self.computed[rid] = start + n

    def propose(
        self, requests: list[tuple[str, Any, int]], prepare: Prepare, fused: FusedRun, choose: Choose
    ) -> dict[str, list[int]]:
        """`room` drafts for each (request id, sequence, room), picked by `choose` from the
        draft model's logits. Each sequence's tokens end with the one the target computes
        first this step, at its num_computed_tokens."""
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
        rooms = {rid: room for rid, _, room in requests}
        # First round: catch up from what the draft model computed to the sequence's last token.
        entries = []
        for rid, seq, _ in requests:
            start = min(self.computed.get(rid, 0), seq.num_computed_tokens)
            entries.append((rid, seq, start, seq.num_computed_tokens + 1 - start))
        while entries:
            following = []
            for (rid, seq, start, n), token in zip(
                entries, self._next_tokens(entries, prepare, fused, choose)
            ):
                self.computed[rid] = start + n
                drafts[rid].append(token)
                if len(drafts[rid]) < rooms[rid]:
                    seq.token_ids.append(token)  # the next round's input
                    following.append((rid, seq, start + n, 1))
            entries = following
        for rid, seq, _ in requests:  # the caller appends the drafts itself
            del seq.token_ids[len(seq.token_ids) - len(drafts[rid]) + 1 :]
        return drafts

    def _next_tokens(
        self, entries: list[tuple[str, Any, int, int]], prepare: Prepare, fused: FusedRun, choose: Choose
    ) -> list[int]:
        """The draft model's token after each entry's tokens (writing their KV)."""
        decoder = self.fused_decoder
        rows = sum(n for *_, n in entries)
        if (
            decoder is not None
            and all(n <= _ROWS_PER_CATCH_UP for *_, n in entries)
            and rows <= decoder.max_rows
        ):
            # A short catch-up (the last window's accepted drafts and bonus token) runs as
            # rows of one token each, as the target's windows do: the fused step, not modules.
            order = list(range(len(entries)))
            flat = [(seq, start + i) for _, seq, start, n in entries for i in range(n)]
            hidden = fused(decoder, flat)
            last = torch.tensor([n for *_, n in entries]).cumsum(0) - 1
        else:
            single = sorted((i for i, e in enumerate(entries) if e[3] == 1), key=lambda i: entries[i][2])
            order = single + [i for i, e in enumerate(entries) if e[3] > 1]
            laid_out = [(entries[i][1], entries[i][2], entries[i][3]) for i in order]
            ids, positions, meta = prepare(laid_out, len(single))
            hidden = self.model(ids, positions, self.kv_caches, meta)
            last = torch.tensor([n for _, _, n in laid_out]).cumsum(0) - 1
        logits = self.model.compute_logits(hidden.index_select(0, last))
        chosen = choose(logits, [(entries[i][0], entries[i][1]) for i in order])
        out = [0] * len(entries)
        for slot, i in enumerate(order):
            out[i] = chosen[slot]
        return out
