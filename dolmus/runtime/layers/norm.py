"""RMSNorm, computed exactly as transformers does (fp32 statistics, weight applied last)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dolmus.runtime.native import ops as native_ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        # Set by the model runner where our C kernel runs (bf16 on an AVX-512 BF16 CPU):
        # one call instead of four ops, ~6x faster on a decode row.
        self.native = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[-1] % 16 == 0:
            return native_ops.rms_norm(x, self.weight, self.eps)
        # Statistics in fp32, cast back, then the weight: transformers' order, so bf16
        # results round the same way. F.rms_norm fuses the middle into one kernel.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)
