"""The engine: request state, scheduling, KV-cache bookkeeping, detokenization."""
