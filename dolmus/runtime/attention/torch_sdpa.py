"""Reference attention on any device: gather the cache by block, then PyTorch SDPA.

Decodes are split into groups of similar length, each attended as one padded batch (one
gather, one SDPA call per layer); each prefill chunk runs on its own, attending to its fresh
k/v directly when it has no cached context. Gathers are `index_select` over whole blocks,
several times faster on CPU than advanced indexing by slot.

Sliding-window layers see the same step through `SDPAMetadata.for_window`: masks that also
hide keys before each query's window, and gathers that skip the blocks no query of a group or
chunk reads (those may have been freed and reused by other requests: what is still gathered
of them is masked out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dolmus.runtime.attention.backend import AttentionBackend, BatchLayout, register_backend
from dolmus.runtime.attention.kv_store import PagedKV


@dataclass
class PrefillSeq:
    """A sequence with more than one new token (a prompt or a chunk of one)."""

    query_start: int  # first of its tokens in the flat batch
    query_len: int
    context_len: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor | None  # blocks holding context + chunk; None if context_len == 0
    # [query_len, keys] bool: the keys from block_ids' first block on (causal, and windowed for a
    # sliding-window layer); None: plain causal over the chunk's own keys
    mask: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Decodes of similar length, attended as one padded batch.

    Grouping by length keeps padding (wasted gathers and dot products) small when short
    and long sequences decode together.
    """

    start: int  # first of the group's tokens in the flat batch
    count: int
    num_blocks: int  # blocks per sequence after padding
    block_ids: torch.Tensor  # [count * num_blocks], row-major
    mask: torch.Tensor  # [count, 1, 1, num_blocks * block_size], 0 or -inf (model dtype)
    lengths: torch.Tensor  # [count] int64: cached positions each sequence attends to
    min_length: int = 0
    max_length: int = 0
    # a sliding-window layer's view: the window, and the positions before block_ids' first
    # block (the mask hides those before each row's window too)
    window: int | None = None
    offset: int = 0


@dataclass
class PrefillTable:
    """Every prefill chunk of the step at once, for a kernel that takes them in one call."""

    block_ids: torch.Tensor  # [num_prefills, blocks] each chunk's blocks, context and chunk
    starts: torch.Tensor  # [num_prefills] int64: first token in the flat batch
    lens: torch.Tensor  # [num_prefills] int64: tokens in the chunk
    contexts: torch.Tensor  # [num_prefills] int64: tokens cached before the chunk


@dataclass
class SDPAMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    block_size: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]
    prefill_table: PrefillTable | None = None  # set by backends with a one-call prefill kernel
    # window -> (decode groups, prefill chunks) as a layer with that window sees them
    windows: dict[int, tuple[list[DecodeGroup], list[PrefillSeq]]] = field(default_factory=dict)

    def for_window(self, window: int) -> tuple[list[DecodeGroup], list[PrefillSeq]]:
        """The step as sliding-window layers see it, built by the first such layer of the step.
        Groups and chunks the window does not cut are returned as they are (the same objects,
        the same list when no chunk is cut), so kernels without a window still take them."""
        seen = self.windows.get(window)
        if seen is None:
            device = self.slot_mapping.device
            groups = [_windowed_group(g, window, self.block_size) for g in self.decode_groups]
            prefills = [_windowed_prefill(p, window, self.block_size, device) for p in self.prefills]
            if all(a is b for a, b in zip(prefills, self.prefills)):
                prefills = self.prefills
            seen = self.windows[window] = (groups, prefills)
        return seen


@register_backend
class TorchSDPABackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, layout: BatchLayout, device: torch.device, dtype: torch.dtype) -> SDPAMetadata:
        bs, nd = layout.block_size, layout.num_decodes
        contexts = layout.context_lens.tolist()
        groups = [
            self._decode_group(layout, start, end, contexts[start:end], device, dtype)
            for start, end in _length_groups(contexts[:nd])
        ]
        prefills: list[PrefillSeq] = []
        start = nd
        for i, n in enumerate(layout.query_lens[nd:].tolist(), start=nd):
            ctx = contexts[i]
            blocks = mask = None
            if ctx:
                blocks = layout.block_table[i, : -(-(ctx + n) // bs)].to(device)
                mask = torch.ones(n, ctx + n, dtype=torch.bool, device=device).tril(ctx)
            prefills.append(PrefillSeq(start, n, ctx, blocks, mask))
            start += n
        return SDPAMetadata(layout.slot_mapping.to(device), bs, groups, prefills)

    @staticmethod
    def _decode_group(
        layout: BatchLayout,
        start: int,
        end: int,
        contexts: list[int],
        device: torch.device,
        dtype: torch.dtype,
    ) -> DecodeGroup:
        bs, count = layout.block_size, end - start
        num_blocks = max(contexts) // bs + 1
        ids = layout.block_table[start:end, :num_blocks]
        lengths = layout.context_lens[start:end].unsqueeze(1) + 1
        span = torch.arange(num_blocks * bs)
        mask = torch.zeros(count, num_blocks * bs, dtype=dtype)
        mask.masked_fill_(span.unsqueeze(0) >= lengths, float("-inf"))
        return DecodeGroup(
            start=start,
            count=count,
            num_blocks=num_blocks,
            block_ids=ids.reshape(-1).to(device),
            mask=mask.view(count, 1, 1, -1).to(device),
            lengths=lengths.view(-1).to(device),
            min_length=min(contexts) + 1,
            max_length=max(contexts) + 1,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: PagedKV,
        meta: SDPAMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        kv_cache.write(meta.slot_mapping, k, v)
        num_tokens, num_heads, _ = q.shape
        value_dim = v.shape[2]  # narrower than q/k's under MLA (runtime/models/mla.py)
        out = torch.empty(num_tokens, num_heads, value_dim, dtype=q.dtype, device=q.device)
        groups, prefills = (meta.decode_groups, meta.prefills) if window is None else meta.for_window(window)
        for g in groups:
            self._decode(q, kv_cache, g, out, meta.block_size, scale)
        self._prefills(q, k, v, kv_cache, meta, prefills, out, scale)
        return out.view(num_tokens, num_heads * value_dim)

    def _prefills(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: PagedKV,
        meta: SDPAMetadata,
        prefills: list[PrefillSeq],
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """Attend every prefill chunk (writes their rows of `out`): one SDPA call each."""
        for seq in prefills:
            s, n = seq.query_start, seq.query_len
            if seq.block_ids is None:
                keys, values = k[s : s + n], v[s : s + n]
            else:
                total = seq.mask.shape[1]  # type: ignore[union-attr]
                keys = kv_cache.blocks(0, seq.block_ids)[:total]
                values = kv_cache.blocks(1, seq.block_ids)[:total]
            mask, causal = seq.mask, seq.mask is None
            res = F.scaled_dot_product_attention(
                q[s : s + n].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=True,
            )
            out[s : s + n] = res.squeeze(0).transpose(0, 1)

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: PagedKV,
        g: DecodeGroup,
        out: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> None:
        """Attend one decode group (writes its rows of `out`)."""
        _, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.data.shape[2]
        n, length = g.count, g.num_blocks * block_size
        keys = kv_cache.blocks(0, g.block_ids).view(n, length, num_kv_heads, head_dim)
        values = kv_cache.blocks(1, g.block_ids)
        values = values.view(n, length, num_kv_heads, values.shape[-1])
        # Grouped-query decode: the query heads sharing a KV head become query rows of
        # that head ([n, Hkv, G, D]), so K/V are never expanded. (SDPA's enable_gqa
        # with a single query row is ~10x slower on CPU.)
        res = F.scaled_dot_product_attention(
            q[g.start : g.start + n].reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=g.mask,
            scale=scale,
        )
        out[g.start : g.start + n] = res.reshape(n, num_heads, -1)


def _length_groups(positions: list[int], min_size: int = 8, spread: float = 1.5) -> list[tuple[int, int]]:
    """Split length-sorted decodes into [start, end) groups of similar length.

    A group closes once it has `min_size` members and the next sequence is `spread` times
    longer than its first: padding stays bounded, and the number of groups (SDPA calls per
    layer) grows only with the log of the length range.
    """
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or (
            i - start >= min_size and positions[i] + 1 > spread * (positions[start] + 1)
        ):
            groups.append((start, i))
            start = i
    return groups


def _windowed_group(g: DecodeGroup, window: int, block_size: int) -> DecodeGroup:
    """The group for a sliding-window layer: position j is seen by the row of length L (query
    at L - 1) when j >= L - window; blocks before the shortest row's window are not gathered."""
    if g.max_length <= window:
        return g
    first = max(g.min_length - window, 0) // block_size
    span = torch.arange(first * block_size, g.num_blocks * block_size, device=g.mask.device)
    mask = g.mask[..., first * block_size :].clone()
    mask.masked_fill_(span.view(1, 1, 1, -1) < (g.lengths - window).view(-1, 1, 1, 1), float("-inf"))
    ids = g.block_ids.view(g.count, g.num_blocks)[:, first:].reshape(-1)
    return DecodeGroup(
        g.start,
        g.count,
        g.num_blocks - first,
        ids,
        mask,
        g.lengths,
        g.min_length,
        g.max_length,
        window,
        first * block_size,
    )


def _windowed_prefill(seq: PrefillSeq, window: int, block_size: int, device: torch.device) -> PrefillSeq:
    """The chunk for a sliding-window layer: the query at position p sees keys in
    (p - window, p], gathered from the block holding the chunk's first query's first key on."""
    ctx, n = seq.context_len, seq.query_len
    if ctx + n <= window:
        return seq
    first = max(ctx - window + 1, 0) // block_size
    q_pos = torch.arange(ctx, ctx + n, device=device).unsqueeze(1)
    k_pos = torch.arange(first * block_size, ctx + n, device=device).unsqueeze(0)
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    blocks = None if seq.block_ids is None else seq.block_ids[first:]
    return PrefillSeq(seq.query_start, n, ctx, blocks, mask)
