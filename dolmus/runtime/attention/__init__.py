"""Attention backends: one contract, a registry, and the implementations."""

from dolmus.runtime.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    BatchLayout,
    backend_names,
    get_backend,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "BatchLayout", "backend_names", "get_backend"]
