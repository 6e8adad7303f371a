"""RMSNorm, computed exactly as transformers does (fp32 statistics, weight applied last)."""

from __future__ import annotations

import torch
from torch import nn

from dolmus.runtime.layers.ops import TORCH_OPS, LayerOps


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: LayerOps = TORCH_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = ops  # PyTorch's ops, or our C kernel where it runs (one call, not four ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x in place (the residual stream's add), then the norm of the sum."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
