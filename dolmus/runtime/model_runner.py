"""Owns the model and the KV-cache memory; turns a SchedulerOutput into sampled tokens.

It never decides who runs: it lays the scheduled tokens out as one flat batch (decodes
first, then prefill chunks), describes where each token's K/V lives, runs the model, and
samples for the requests whose chunk reached their last token.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from dolmus.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    DEFAULT_GPU_KV_CACHE_FRACTION,
    EngineConfig,
    ModelConfig,
)
from dolmus.engine.request import SampledToken
from dolmus.engine.scheduler import ScheduledRequest, SchedulerOutput
from dolmus.quant.methods import make_linear_method
from dolmus.runtime import native
from dolmus.runtime.attention import AttentionMetadata, DecodeGroup, PrefillSeq, get_backend
from dolmus.runtime.attention.kv_store import kv_bytes_per_token, make_kv_store
from dolmus.runtime.layers.linear import module_bytes
from dolmus.runtime.loader import load_model
from dolmus.runtime.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_path: Path,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        progress: bool = False,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        if config.num_threads and device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        # Our C kernels for norms, rotary, SiLU and decode attention: bf16 on an AVX-512 BF16 CPU.
        self.native_kernels = (
            config.native_kernels
            and device.type == "cpu"
            and dtype == torch.bfloat16
            and native.library() is not None
        )
        self.model = load_model(
            model_path,
            model_config,
            dtype,
            device,
            make_linear_method(
                config.prepack_weights,
                config.quantization,
                config.quant_group_size,
                config.quant_symmetric,
                config.quant_lm_head,
                config.native_kernels,
            ),
            get_backend("torch", native=self.native_kernels),
            max_model_len,
            progress=progress,
        )
        for module in self.model.modules():  # norms, attention and MLP layers carry the switch
            if isinstance(getattr(module, "native", None), bool):
                module.native = self.native_kernels
        self.num_blocks = self._plan_kv_blocks(max_model_len)
        cfg = model_config
        slots = self.num_blocks * self.block_size
        self.kv_caches = [
            make_kv_store(
                config.kv_cache_dtype, slots, cfg.num_kv_heads, cfg.head_dim, self.block_size, dtype, device
            )
            for _ in range(cfg.num_layers)
        ]
        self.weight_bytes = module_bytes(self.model)
        self.sampler = Sampler(device, config.seed)
        self._generators: dict[str, torch.Generator] = {}

    def _plan_kv_blocks(self, max_model_len: int) -> int:
        mc = self.model_config
        per_token = mc.num_layers * kv_bytes_per_token(
            self.config.kv_cache_dtype, mc.num_kv_heads, mc.head_dim, self.dtype
        )
        per_block = per_token * self.block_size
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                budget = int(available_memory(self.device) * DEFAULT_GPU_KV_CACHE_FRACTION)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        elif budget <= 1:
            budget = int(available_memory(self.device) * budget)
        num_blocks = int(budget) // per_block
        # More blocks than every seat at full length (plus as many again for the prefix
        # cache) would only be memory no one uses.
        useful = 2 * self.config.max_num_seqs * -(-max_model_len // self.block_size)
        num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {int(budget)} bytes holds no block of {per_block} bytes")
        self.kv_bytes_per_token = per_token
        logger.info(
            "KV cache (%s): %d blocks of %d tokens = %d tokens fit (%.1f MB, %d bytes per token)",
            self.config.kv_cache_dtype,
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            num_blocks * per_block / 1e6,
            per_token,
        )
        return num_blocks

    # -- one step -------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[str, SampledToken]:
        for request_id in sched.finished_ids:
            self._generators.pop(request_id, None)
        if sched.empty:
            return {}
        # Decodes sorted by length, so similar lengths share a padded attention group.
        decodes = sorted(
            (s for s in sched.scheduled if s.num_new_tokens == 1), key=lambda s: s.request.num_computed_tokens
        )
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        input_ids, positions, meta = self._prepare(ordered, len(decodes), sched.block_tables)

        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        sample_index, rows, ids = [], [], []
        offset = 0
        for item in ordered:
            offset += item.num_new_tokens
            if item.samples:
                sample_index.append(offset - 1)
                rows.append(self._sampling_row(item))
                ids.append(item.request.request_id)
        if not rows:
            return {}
        index = torch.tensor(sample_index, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return dict(zip(ids, self.sampler(logits, rows)))

    @torch.inference_mode()
    def prompt_logits(self, item: ScheduledRequest, block_table: list[int]) -> torch.Tensor:
        """Logits at every position of one prefill chunk: what scoring a text needs."""
        ids, positions, meta = self._prepare([item], 0, {item.request.request_id: block_table})
        return self.model.compute_logits(self.model(ids, positions, self.kv_caches, meta))

    def _prepare(
        self, ordered: list[ScheduledRequest], num_decodes: int, block_tables: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs, dev = self.block_size, self.device
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for item in ordered[:num_decodes]:
            r = item.request
            pos = r.num_computed_tokens
            tokens.append(r.all_token_ids[pos])
            positions.append(pos)
            slots.append(block_tables[r.request_id][pos // bs] * bs + pos % bs)
        groups = [
            self._decode_group(start, ordered[start:end], positions[start:end], block_tables)
            for start, end in _length_groups(positions)
        ]

        prefill_seqs: list[PrefillSeq] = []
        slot_chunks = [torch.tensor(slots, dtype=torch.long)]
        start = num_decodes
        for item in ordered[num_decodes:]:
            r, n = item.request, item.num_new_tokens
            ctx = r.num_computed_tokens
            tokens.extend(r.all_token_ids[ctx : ctx + n])
            positions.extend(range(ctx, ctx + n))
            table = block_tables[r.request_id]
            span = torch.arange(ctx, ctx + n)
            slot_chunks.append(torch.tensor(table, dtype=torch.long)[span // bs] * bs + span % bs)
            blocks = mask = None
            if ctx:
                blocks = torch.tensor(table[: -(-(ctx + n) // bs)], dtype=torch.long, device=dev)
                mask = torch.ones(n, ctx + n, dtype=torch.bool, device=dev).tril(ctx)
            prefill_seqs.append(PrefillSeq(start, n, ctx, blocks, mask))
            start += n

        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_chunks).to(dev),
            block_size=bs,
            decode_groups=groups,
            prefills=prefill_seqs,
        )
        return (
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
        )

    def _decode_group(
        self,
        start: int,
        items: list[ScheduledRequest],
        positions: list[int],
        block_tables: dict[str, list[int]],
    ) -> DecodeGroup:
        bs = self.block_size
        num_blocks = max(positions) // bs + 1
        ids = torch.zeros(len(items), num_blocks, dtype=torch.long)
        for i, item in enumerate(items):
            row = block_tables[item.request.request_id][:num_blocks]
            ids[i, : len(row)] = torch.tensor(row)
        span = torch.arange(num_blocks * bs)
        lengths = torch.tensor(positions).unsqueeze(1) + 1
        mask = torch.zeros(len(items), num_blocks * bs, dtype=self.dtype)
        mask.masked_fill_(span.unsqueeze(0) >= lengths, float("-inf"))
        return DecodeGroup(
            start=start,
            count=len(items),
            num_blocks=num_blocks,
            block_ids=ids.view(-1).to(self.device),
            mask=mask.view(len(items), 1, 1, -1).to(self.device),
            lengths=lengths.view(-1).to(self.device),
        )

    def _sampling_row(self, item: ScheduledRequest) -> SamplingRow:
        r = item.request
        gen = None
        if r.seed is not None:
            gen = self._generators.get(r.request_id)
            if gen is None:
                gen = torch.Generator(self.device).manual_seed(r.seed)
                self._generators[r.request_id] = gen
        return SamplingRow(
            params=r.params,
            generator=gen,
            prompt_ids=r.prompt_token_ids,
            output_ids=r.output_token_ids,
            stop_ids=sorted(r.stop_token_ids),
            grammar=r.grammar,
        )


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
