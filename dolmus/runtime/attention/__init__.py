"""Attention backends: one interface, a registry, and the implementations."""

from dolmus.runtime.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    DecodeGroup,
    PrefillSeq,
    get_backend,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "DecodeGroup", "PrefillSeq", "get_backend"]
