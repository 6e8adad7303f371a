"""The KV connector: moves KV blocks out of and into the paged cache by their chained hashes.

Two sides, as vLLM's v1 connector draws them. The scheduler side (engine/kv_transfers.py,
beside the scheduler it serves) decides how many of a request's next tokens a store outside
the cache holds, what to load into which blocks, and what to save when a block is evicted, a
request is preempted or a prefill finishes for a remote decode; it writes that into the step
plan (step.KVTransfer). The worker side (worker_side.py, here with the stores and the transfer
it uses) does it around the forward pass on every rank and reports what it loaded in the step
result, so the same code runs in one process, across worker processes and across hosts.
"""
