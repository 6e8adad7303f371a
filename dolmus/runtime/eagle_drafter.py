"""EAGLE-3 speculative decoding in the runner: the head (models/eagle3.py), its one-layer KV
pool in the target's blocks, and what it carries from one step to the next.

After every step the head runs over the positions the target computed and kept (prompt
chunks, decodes, the accepted part of a window), each with the token after it and the
target's captured hidden states: that writes the head's KV there, and its output at a
request's last position predicts the first draft of the next step. A step that drafts then
runs the head on its own guesses, one position per further draft, feeding each output back as
the next position's feature; the next step's catch-up overwrites that KV with the target's.
A block shared through the prefix cache had the head's KV written by the request that
computed it, with the same tokens and features, so cached prompts need no head work.

DeepSeek-V3's MTP layer (models/deepseek_mtp.py) drafts the same way: one layer that reads the
next token's embedding and a feature of the position (the target's final hidden state, not
captured layers: its `reads_final_hidden`), with a latent KV pool (its `kv_layout`).
"""

from __future__ import annotations

from typing import Any

import torch

from dolmus.runtime.attention.kv_store import PagedKV, kv_bytes_per_token, make_kv_store
from dolmus.runtime.draft_model import Choose, Prepare
from dolmus.runtime.models.deepseek_mtp import MTPHead
from dolmus.runtime.models.eagle3 import Eagle3Head


class EagleDrafter:
    def __init__(self, head: Eagle3Head | MTPHead) -> None:
        self.head = head
        self.kv_cache: PagedKV | None = None
        # request id -> (normed output, output before the norm, position) at its last kept position
        self.last: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def kv_bytes_per_token(self, kv_cache_dtype: str, dtype: torch.dtype) -> int:
        heads, width, value_dim = self.head.kv_layout()
        return kv_bytes_per_token(kv_cache_dtype, heads, width, dtype, latent=value_dim is not None)

    def allocate(
        self, kv_cache_dtype: str, slots: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        heads, width, value_dim = self.head.kv_layout()
        self.kv_cache = make_kv_store(
            kv_cache_dtype, slots, heads, width, block_size, dtype, device, value_dim
        )

    def forget(self, request_id: str) -> None:
        self.last.pop(request_id, None)

    def follow(
        self, spans: list[tuple[str, Any, int, int, list[int]]], captured: torch.Tensor, prepare: Prepare
    ) -> None:
        """The head over the positions the target kept this step. spans: (request id, its
        sequence, first position, how many, the target's flat rows of them); the sequence's
        tokens already hold the token after the last one."""
        spans = sorted(spans, key=lambda s: s[3] > 1)  # single positions first, as layouts want
        entries = [(seq, first, n) for _, seq, first, n, _ in spans]
        _, positions, meta = prepare(entries, sum(n == 1 for _, _, n in entries))
        ids = torch.tensor(
            [t for _, seq, first, n, _ in spans for t in seq.token_ids[first + 1 : first + 1 + n]]
        )
        rows = torch.tensor([r for *_, rows in spans for r in rows])
        features = self.head.combine(captured.index_select(0, rows))
        normed, out = self.head(ids, positions, features, self.kv_cache, meta)
        end = 0
        for rid, _, first, n, _ in spans:
            end += n
            self.last[rid] = (normed[end - 1], out[end - 1], first + n - 1)

    def propose(
        self, requests: list[tuple[str, Any, int]], prepare: Prepare, choose: Choose
    ) -> dict[str, list[int]]:
        """`room` drafts for each (request id, sequence, room); each sequence's tokens end with
        the one the target computes first this step, at its num_computed_tokens."""
        drafts: dict[str, list[int]] = {}
        appended: dict[str, int] = {}
        live = []
        for rid, seq, room in requests:
            state = self.last.get(rid)
            if state is None or state[2] != seq.num_computed_tokens - 1:
                # nothing kept for its last position (never seen whole): slots filled with
                # a guess the target will turn down, so the scheduled window keeps its size
                drafts[rid] = [seq.token_ids[-1]] * room
            else:
                drafts[rid] = []
                live.append((rid, seq, room, state[0], state[1]))
        round_ = 0
        while live:
            normed = torch.stack([n for *_, n, _ in live])
            tokens = choose(self.head.compute_logits(normed), [(rid, seq) for rid, seq, *_ in live])
            going = []
            for (rid, seq, room, _, out), token in zip(live, tokens):
                drafts[rid].append(token)
                if len(drafts[rid]) < room:
                    going.append((rid, seq, room, out))
            if not going:
                break
            # The head at the next position: the draft just made, its own output as the feature.
            entries = []
            for rid, seq, _, _ in going:
                seq.token_ids.append(drafts[rid][-1])
                appended[rid] = appended.get(rid, 0) + 1
                entries.append((seq, seq.num_computed_tokens + round_, 1))
            _, positions, meta = prepare(entries, len(entries))
            ids = torch.tensor([drafts[rid][-1] for rid, *_ in going])
            features = torch.stack([out for *_, out in going])
            normed_rows, outs = self.head(ids, positions, features, self.kv_cache, meta)
            live = [(rid, seq, room, normed_rows[i], outs[i]) for i, (rid, seq, room, _) in enumerate(going)]
            round_ += 1
        for rid, seq, _ in requests:  # the caller appends the drafts itself
            if appended.get(rid):
                del seq.token_ids[-appended[rid] :]
        return drafts
