"""bf16 weights under a float32 model on CPUs without bf16 arithmetic (AVX2): half the bytes.

Where bf16 is emulated (no AVX-512 BF16, no AMX) a bf16 checkpoint runs in float32, and a
decode step, which reads every weight once, reads 4 bytes per weight. Kept as the bf16 they
were (exact: a float32 weight is stored so only if its bf16 rounding is itself) and widened in
registers (bf16_weights_f32.c), the step reads 2. Prefill chunks run there too: on an AVX2-only
AMD EPYC (Zen 3, 2 cores) the kernel reaches ~155-180 GFLOP/s at 512 rows, near the
cores' FMA peak and level with or above oneDNN's float32 product on float32 weights, and
widening the weight for PyTorch's product instead cost more than the product
(benchmarks/bf16_weights_avx2.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dolmus.runtime import native

PANEL = 16  # outputs per panel of the packed layout
# A panel's 16 outputs at one input, in memory: 0, 8, 1, 9, ..., 7, 15. Read as eight 32-bit
# lanes, the low halves hold outputs 0-7 and the high halves 8-15, so the kernel widens them to
# floats with one shift and one and (no shuffles, which share the vector pipes with the FMAs).
INTERLEAVE = [o for i in range(PANEL // 2) for o in (i, i + PANEL // 2)]
DEINTERLEAVE = sorted(range(PANEL), key=INTERLEAVE.__getitem__)


def ready() -> bool:
    """Whether float32 layers keep bf16-exact weights in bf16 here: the AVX2 kernels run, and
    the CPU has no bf16 arithmetic (where it has, such checkpoints run in bf16 instead)."""
    return native.avx2_library() is not None and not native.cpu_has_bf16()


def exact_in_bf16(w: torch.Tensor) -> bool:
    """Whether every value of a float32 tensor is a bf16 value (a bf16 checkpoint's weights)."""
    return w.dtype == torch.float32 and torch.equal(w.bfloat16().float(), w)


def pack(w: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 (exact in bf16) -> bf16 panels [ceil(N / 16), K, 16] (outputs in
    INTERLEAVE's order), zero past N."""
    n, k = w.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = w
    return padded.view(-1, PANEL, k)[:, INTERLEAVE].transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The packed weight back as [N, K] float32."""
    panels, k, _ = packed.shape
    return packed[:, :, DEINTERLEAVE].transpose(1, 2).reshape(panels * PANEL, k)[:n].float()


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 times the packed [N, K] weight, plus a float32 bias -> [..., N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, k).contiguous()
    m = x.shape[0]
    if x.dtype != torch.float32:  # not a float32 model's activations: PyTorch's product
        b = bias.to(x.dtype) if bias is not None else None
        return F.linear(x, unpack(packed, n).to(x.dtype), b).view(*lead, n)
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        bias_ptr = bias.data_ptr() if bias is not None else None
        native.avx2_library().dolmus_bf16w_gemm_f32(
            x.data_ptr(), packed.data_ptr(), bias_ptr, y.data_ptr(), m, n, k
        )
    return y.view(*lead, n)
