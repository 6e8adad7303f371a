"""Unified paged attention for CUDA GPUs, in Triton: prefill chunks and decodes in one launch.

The step's new keys and values are already in the paged cache (`[slots, Hkv, D]` per layer,
slot = block_id * block_size + offset). Sequence s has query tokens
q[query_start_loc[s]:query_start_loc[s + 1]] and attends to seq_lens[s] keys after the step; its
query i sits at position p = seq_lens[s] - q_len + i and sees keys 0..p (and only those in
(p - window, p] on a sliding-window layer), found through its row of the block table.

One program takes one sequence, one tile of its query tokens and one KV head. Its rows are the
tile's tokens times the G = Hq / Hkv query heads sharing that KV head, flattened (row r: token
r // G, head r % G) and padded to a power of two of at least 16 (what tl.dot takes), so each
key and value tile is read once per KV head and never expanded for grouped-query attention.
Keys are walked in tiles of BLOCK_N positions, each position's slot looked up in the block
table (the tile may straddle blocks, and block ids may be in any order), with an online
softmax in float32 (base 2, the scale folded into the exponent). The walk starts at the first
key any row of the tile can see, so blocks before every query's window (which the engine may
have freed and reused) are never read, and stops after the tile's last query position.

Quantized caches (int8 codes, or float8 e4m3 codes kept in uint8 storage, one scale per
(token, KV head), as kv_store.QuantizedPagedKV stores them) are dequantized per tile in
registers: keys and values cross memory at 8 bits. The codes convert exactly to the compute
dtype and the per-key scales multiply the scores (keys) and the probabilities (values).
Float32 inputs multiply in IEEE float32 (no TF32), so they match a float64 reference to ~1e-5;
bf16/fp16 use the tensor cores.

CUDA graphs: the grid is (S, cdiv(max_query_len, BLOCK_Q), Hkv), from host integers only, and
everything else (lengths, starts, block ids) is read from tensors, so a graph captured at one
batch size replays with new contents. A sequence with seq_lens 0 (a pad row) reads nothing and
writes zeros. Every output row of a sequence is written; rows past query_start_loc[S] belong to
no sequence and are left alone.

Tiles: decode-only calls (max_query_len == 1) use 16 rows (the G heads of one token: the most
a decode can fill), calls with prefill chunks 64 rows (32 for heads wider than 128); 64 keys
per iteration (32 for heads wider than 128), 4 warps. Constexpr specialisations: two row tiles
per (G, head dim, cache kind, window on/off, dtype), plus the split-KV variant.

Split-KV (flash-decoding): a decode-only call with few sequences gives too few programs to
fill the GPU (1 sequence x 8 KV heads = 8 programs on 132 multiprocessors). Then each
sequence's keys are cut into `num_splits` parts of whole key tiles (grid axis 1), each part
writes a float32 partial output and its log-sum-exp, and a second kernel (grid S x Hq)
combines them. The number of splits comes from S, Hkv and the GPU, never from tensor contents,
so it too is graph-safe; splits past a short sequence's keys read nothing.

The same kernels run on the CPU under Triton's interpreter (TRITON_INTERPRET=1), which is how
tests/test_triton_attention.py checks them; the same test compiles them on a CUDA GPU when
there is one. Not checked by that interpreter: bfloat16 (its bf16 tl.dot is wrong in Triton
3.9). Float8 codes convert in hardware on sm_89 and later and by bit moves before
(`FP8_DECODE`).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton ships with CUDA builds of PyTorch; CPU installs may lack it
    triton = None

_KV_CODES = {"auto": 0, "int8": 1, "fp8": 2}
_FP8_BITS = 3  # KV_CODES for float8 codes decoded by bit moves (GPUs before sm_89)
# How float8 e4m3 codes become numbers: "auto" converts in hardware on sm_89 and later (and in
# the interpreter) and by bit moves on older GPUs, which have no e4m3 conversion; "bits" or
# "hardware" force one (the tests run both).
FP8_DECODE = "auto"
_LOG2E = 1.4426950408889634


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _e4m3_as_fp16(codes):
        # float8 e4m3 bits s.eeee.mmm placed as float16 bits s.0eeee.mmm0000000: the same
        # number divided by 2^8 (the exponent biases are 7 and 15), subnormals included; the
        # caller multiplies the 2^8 back into the scales. No float8 hardware needed.
        b = codes.to(tl.int32)  # uint8: zero-extended
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)  # < 2^16: the int16 cast keeps the bits
        return bits.to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        part_ptr,  # split-KV only: [T, Hq, splits, D] float32 partial outputs
        lse_ptr,  # split-KV only: [T, Hq, splits] float32 log2-sum-exp of each split
        ks_ptr,
        vs_ptr,
        bt_ptr,
        seq_lens_ptr,
        qsl_ptr,
        qk_scale,  # scale * log2(e): the softmax runs in base 2
        window,
        block_size,
        num_heads,
        num_splits,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_ks,  # key/value cache: slot, head (the last dim is contiguous)
        stride_kh,
        stride_vs,
        stride_vh,
        stride_sss,  # scales: slot, head
        stride_ssh,
        stride_bt,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        KV_CODES: tl.constexpr,  # 0 plain, 1 int8, 2 float8 e4m3 in uint8 storage, 3 the same by bits
        USE_WINDOW: tl.constexpr,
        IEEE: tl.constexpr,
        SPLIT: tl.constexpr,  # decode only: axis 1 is the split of the keys, not a query tile
    ):
        seq = tl.program_id(0)
        if SPLIT:
            tile_start = 0
        else:
            tile_start = tl.program_id(1) * BLOCK_Q
        kv_head = tl.program_id(2)

        q_begin = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_begin
        seq_len = tl.load(seq_lens_ptr + seq)

        rows = tl.arange(0, BLOCK_M)
        tok = tile_start + rows // G  # the row's query token within the sequence
        head = kv_head * G + rows % G
        row_ok = (rows < BLOCK_Q * G) & (tok < q_len)
        pos = seq_len - q_len + tok  # the row's query position
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM

        q_off = (q_begin + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        # Keys any row of the tile can see: [k_lo, k_hi). Empty for a tile past the sequence's
        # tokens and for a pad row (seq_len 0): nothing is read.
        tile_len = tl.minimum(q_len - tile_start, BLOCK_Q)
        k_hi = tl.where(tile_len > 0, seq_len - q_len + tile_start + tile_len, 0)
        k_hi = tl.maximum(k_hi, 0)
        k_lo = 0
        if USE_WINDOW:
            k_lo = tl.maximum(seq_len - q_len + tile_start - window + 1, 0)
        if SPLIT:
            # whole key tiles per split; the last splits of a short sequence are empty
            split = tl.program_id(1)
            chunk = tl.cdiv(tl.cdiv(tl.maximum(k_hi - k_lo, 0), num_splits), BLOCK_N) * BLOCK_N
            k_lo = k_lo + split * chunk
            k_hi = tl.minimum(k_lo + chunk, k_hi)

        m = tl.full((BLOCK_M,), -1e30, dtype=tl.float32)  # finite: a fully masked tile gives no NaN
        denom = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        for k0 in range(k_lo, k_hi, BLOCK_N):
            j = k0 + tl.arange(0, BLOCK_N)
            j_ok = j < k_hi
            block = tl.load(bt_row + j // block_size, mask=j_ok, other=0).to(tl.int64)
            slot = block * block_size + j % block_size
            kv_mask = j_ok[:, None] & d_ok[None, :]
            k = tl.load(
                k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0
            )
            v = tl.load(
                v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0
            )
            if KV_CODES != 0:
                s_off = slot * stride_sss + kv_head * stride_ssh
                k_s = tl.load(ks_ptr + s_off, mask=j_ok, other=0.0).to(tl.float32)
                v_s = tl.load(vs_ptr + s_off, mask=j_ok, other=0.0).to(tl.float32)
                if KV_CODES == 2:
                    k = k.to(tl.float8e4nv, bitcast=True)
                    v = v.to(tl.float8e4nv, bitcast=True)
                if KV_CODES == 3:
                    k = _e4m3_as_fp16(k)
                    v = _e4m3_as_fp16(v)
                    k_s = k_s * 256.0
                    v_s = v_s * 256.0
                # codes are exact in the compute dtype (int8 and e4m3 fit bf16/fp16 mantissas);
                # the scales go on the products: BLOCK_M x BLOCK_N multiplies, not BLOCK_N x D
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            if KV_CODES != 0:
                qk = qk * k_s[None, :]
            seen = j_ok[None, :] & (j[None, :] <= pos[:, None])
            if USE_WINDOW:
                seen = seen & (j[None, :] > pos[:, None] - window)
            qk = tl.where(seen, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(qk - m_new[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            if KV_CODES != 0:
                p = p * v_s[None, :]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        # Rows that saw no key (pad rows, padding of the tile) write zeros, not 0/0.
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        store_ok = row_ok[:, None] & d_ok[None, :]
        if SPLIT:
            at = ((q_begin + tok).to(tl.int64) * num_heads + head) * num_splits + tl.program_id(1)
            tl.store(part_ptr + at[:, None] * HEAD_DIM + d[None, :], out, mask=store_ok)
            lse = tl.where(denom > 0, m + tl.log2(tl.where(denom > 0, denom, 1.0)), float("-inf"))
            tl.store(lse_ptr + at, lse, mask=row_ok)
        else:
            o_off = (q_begin + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=store_ok)

    @triton.jit
    def _combine_splits_kernel(
        part_ptr,
        lse_ptr,
        o_ptr,
        qsl_ptr,
        num_heads,
        num_splits,
        stride_ot,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        # One program per (decode sequence, query head): weigh each split's partial output by
        # its share of the softmax sum. Splits that saw no key (lse -inf) are never read.
        seq = tl.program_id(0)
        head = tl.program_id(1)
        t = tl.load(qsl_ptr + seq)
        has_token = tl.load(qsl_ptr + seq + 1) > t
        # (bounds, not `& has_token`: the interpreter rejects a scalar-broadcast bool mask)
        splits = tl.where(has_token, num_splits, 0)
        dims = tl.where(has_token, HEAD_DIM, 0)
        sp = tl.arange(0, SPLITS_PAD)
        at = (t.to(tl.int64) * num_heads + head) * num_splits + sp
        lse = tl.load(lse_ptr + at, mask=sp < splits, other=float("-inf"))
        top = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
        total = tl.sum(w, 0)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        part = tl.load(
            part_ptr + at[:, None] * HEAD_DIM + d[None, :],
            mask=(lse > float("-inf"))[:, None] & d_ok[None, :],
            other=0.0,
        )
        out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        o_off = t.to(tl.int64) * stride_ot + head * stride_oh + d
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=d < dims)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    block_size: int,
    scale: float,
    window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_codes: str = "auto",
    num_splits: int | None = None,
) -> None:
    """Attend every sequence's queries to its paged keys/values; writes `out` [T, Hq, D].

    q: [T, Hq, D]; key_cache/value_cache: [slots, Hkv, D] in the model dtype, int8 codes
    (`kv_codes="int8"`) or uint8 storage of float8 e4m3 codes (`"fp8"`), with k_scale/v_scale
    [slots, Hkv] (value = code * scale); block_table [S, W], seq_lens [S] (keys after the step,
    0 = pad row: zeros out), query_start_loc [S + 1], all int64 on q's device. max_query_len
    (a host int) and S size the grid, nothing else does: safe to capture in a CUDA graph.

    num_splits: decode-only calls (max_query_len == 1) may split each sequence's keys into that
    many parts attended in parallel, then combined (flash-decoding): for few sequences with
    long contexts, which would otherwise leave most of the GPU idle. None picks from S, Hkv
    and the GPU's multiprocessor count (graph-safe: no tensor contents); 1 never splits.
    """
    if triton is None:
        raise RuntimeError("the Triton attention backend needs Triton (pip install triton)")
    if kv_codes not in _KV_CODES:
        raise ValueError(f"kv_codes must be one of {sorted(_KV_CODES)}, not {kv_codes!r}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if key_cache.shape[2] != head_dim or value_cache.shape[2] != head_dim or out.shape != q.shape:
        raise ValueError(
            f"head dims differ: q {tuple(q.shape)}, keys {tuple(key_cache.shape)}, "
            f"values {tuple(value_cache.shape)}, out {tuple(out.shape)}"
        )
    for name, t in (("q", q), ("out", out), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension")
    quantized = kv_codes != "auto"
    if quantized:
        if k_scale is None or v_scale is None:
            raise ValueError(f"kv_codes={kv_codes!r} needs k_scale and v_scale")
        if k_scale.stride() != v_scale.stride():
            raise ValueError("k_scale and v_scale must have the same strides")
        want = torch.int8 if kv_codes == "int8" else torch.uint8
        if key_cache.dtype != want or value_cache.dtype != want:
            raise ValueError(f"kv_codes={kv_codes!r} expects {want} cache storage, got {key_cache.dtype}")
    if window is not None and window < 1:
        raise ValueError(f"window must be positive, got {window}")
    num_seqs = block_table.shape[0]
    if num_seqs == 0 or max_query_len <= 0:
        return
    if num_splits is None:
        num_splits = _auto_splits(num_seqs, num_kv_heads, max_query_len, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    split = num_splits > 1 and max_query_len == 1

    group = num_heads // num_kv_heads
    d_pad = max(16, _pow2(head_dim))
    # float32 accumulators of BLOCK_M x D_PAD live in registers: fewer rows for wide heads
    block_m = max(16 if max_query_len == 1 else (64 if d_pad <= 128 else 32), _pow2(group))
    block_q = block_m // group
    block_n = 64 if d_pad <= 128 else 32
    scales = (k_scale, v_scale) if quantized else (key_cache, value_cache)  # unread if plain
    if split:
        part = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        grid = (num_seqs, num_splits, num_kv_heads)
    else:
        part = lse = out  # unread
        grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        part,
        lse,
        scales[0],
        scales[1],
        block_table,
        seq_lens,
        query_start_loc,
        scale * _LOG2E,
        window or 0,
        block_size,
        num_heads,
        num_splits if split else 1,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        k_scale.stride(0) if quantized else 0,
        k_scale.stride(1) if quantized else 0,
        block_table.stride(0),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        G=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        KV_CODES=_FP8_BITS if kv_codes == "fp8" and _fp8_by_bits(q.device) else _KV_CODES[kv_codes],
        USE_WINDOW=window is not None,
        IEEE=q.dtype == torch.float32,
        SPLIT=split,
        num_warps=4,
        num_stages=2,
    )
    if split:
        _combine_splits_kernel[(num_seqs, num_heads)](
            part,
            lse,
            out,
            query_start_loc,
            num_heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            SPLITS_PAD=_pow2(num_splits),
            num_warps=4,
        )


_SM_COUNT: dict[int, int] = {}


def _fp8_by_bits(device: torch.device) -> bool:
    if FP8_DECODE not in ("auto", "bits", "hardware"):
        raise ValueError(f"FP8_DECODE must be 'auto', 'bits' or 'hardware', not {FP8_DECODE!r}")
    if FP8_DECODE != "auto":
        return FP8_DECODE == "bits"
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def _auto_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, device: torch.device) -> int:
    """Splits for a decode call: enough programs for about one per multiprocessor, at most 16
    (each split writes float32 partials); none when the sequences alone fill the GPU."""
    if max_query_len != 1 or device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    programs = num_seqs * num_kv_heads
    if 2 * programs > _SM_COUNT[index]:
        return 1
    return min(16, _SM_COUNT[index] // programs)
