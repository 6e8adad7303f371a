"""Owns the model and the KV-cache memory; turns a StepPlan into a StepResult.

It never decides who runs. It keeps its own copy of every scheduled request (token ids, a
row of a persistent block-table tensor, sampling settings), updated from each plan's diff
(runtime/persistent_batch.py); lays the scheduled tokens out as one flat batch (decodes
first, then prefill chunks); has the attention backend describe where each token's K/V
lives; runs the model; and samples for the requests whose chunk reached their last token,
appending what it sampled to its copy.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dolmus.config import EngineConfig, ModelConfig
from dolmus.distributed.parallel_config import SINGLE_RANK, ParallelConfig
from dolmus.kv_connector.worker_side import make_worker_connector
from dolmus.quant.methods import make_linear_method
from dolmus.runtime import native
from dolmus.runtime.attention import AttentionBackend, get_backend
from dolmus.runtime.attention.kv_store import make_kv_store
from dolmus.runtime.batch_inputs import BatchInputs, RunnerSequence, sampling_row
from dolmus.runtime.cpu_profile import usable_cores
from dolmus.runtime.cuda_graphs import CudaGraphDecoder, graphs_emulated
from dolmus.runtime.draft_loading import Target, load_drafters
from dolmus.runtime.draft_sampling import DraftSampling
from dolmus.runtime.expert_load import ExpertLoad
from dolmus.runtime.inflight import InflightTokens, LaunchedStep
from dolmus.runtime.kernel_choice import attention_backend_name, layer_ops, suited_step_tokens
from dolmus.runtime.kv_sizing import plan_kv_blocks, target_kv_bytes_per_token
from dolmus.runtime.layers.linear import module_bytes
from dolmus.runtime.loader import load_model
from dolmus.runtime.models.llama_decode import FusedDecoder
from dolmus.runtime.persistent_batch import PersistentBatch
from dolmus.runtime.pooler import Pooler
from dolmus.runtime.runner_spec import RunnerSpec
from dolmus.runtime.sampler import Sampler
from dolmus.sampling_params import SamplingParams
from dolmus.spec.proposer import DRAFTED_BY_RUNNER
from dolmus.spec.verify import accepted_tokens
from dolmus.step import StepPlan, StepResult

logger = logging.getLogger(__name__)


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
        parallel: ParallelConfig = SINGLE_RANK,
        local_ranks: int = 1,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.parallel, self.local_ranks = parallel, local_ranks
        self.num_kv_heads = parallel.kv_heads(model_config.num_kv_heads)[1]  # this rank's
        if device.type == "cpu":
            threads = config.num_threads
            if threads is None and local_ranks > 1:  # the host's cores, split between its ranks
                threads = max(1, usable_cores() // local_ranks)
            if threads:
                torch.set_num_threads(threads)
        # Our C kernels for norms, rotary, SiLU and decode attention: bf16 on an AVX-512 BF16
        # CPU, float32 on an AVX2 one.
        self.native_kernels = (
            config.native_kernels
            and device.type == "cpu"
            and (
                (dtype == torch.bfloat16 and native.library() is not None)
                or (dtype == torch.float32 and native.avx2_library() is not None)
            )
        )
        latent = model_config.kv_layout(self.num_kv_heads)[2] is not None
        self.attention: AttentionBackend = get_backend(
            attention_backend_name(config, device, self.native_kernels, latent)
        )
        ops = layer_ops(config, self.attention.name, self.native_kernels)
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
            self.attention,
            max_model_len,
            progress=progress,
            parallel=parallel,
            ops=ops,
            int8_block_activations=config.gguf_activations == "int8",
        )
        spec = config.speculative_config
        target = Target(config, model_config, self.model, model_path, dtype, device, self.attention, ops)
        drafters = load_drafters(spec, target, max_model_len)
        self.drafter, self.medusa = drafters.draft, drafters.medusa
        self.eagle = drafters.eagle  # an EAGLE-3 head, or DeepSeek-V3's MTP layer (drafting alike)
        per_token = target_kv_bytes_per_token(model_config, self.num_kv_heads, config.kv_cache_dtype, dtype)
        for extra in (self.drafter, self.eagle):  # their pools have the same blocks
            if extra is not None:
                per_token += extra.kv_bytes_per_token(config.kv_cache_dtype, dtype)
        self.kv_bytes_per_token = per_token
        self.num_blocks = plan_kv_blocks(config, per_token, device, max_model_len, parallel, local_ranks)
        cfg = model_config
        slots = self.num_blocks * self.block_size
        # CUDA graphs pad batches with rows whose keys and values go to one spare block
        graphs = (
            (device.type == "cuda" or graphs_emulated())
            and not config.enforce_eager
            and self.attention.supports_cuda_graphs
        )
        if graphs:
            slots += self.block_size
        heads, width, value_dim = cfg.kv_layout(self.num_kv_heads)
        self.kv_caches = [
            make_kv_store(
                config.kv_cache_dtype, slots, heads, width, self.block_size, dtype, device, value_dim
            )
            for _ in range(cfg.num_layers)
        ]
        for extra in (self.drafter, self.eagle):  # their pools have the target's blocks
            if extra is not None:
                extra.allocate(config.kv_cache_dtype, slots, self.block_size, dtype, device)
        self.weight_bytes = module_bytes(self.model)
        self.expert_load = ExpertLoad.of(self.model, model_config.num_layers)  # None: no MoE layers
        self.step_tokens = suited_step_tokens(self.model, device)
        # Decode steps (drafts included: one row per position), and steps with prompt chunks
        # where the prefill kernel takes every layer, in one C call, where the whole model runs
        # on our kernels.
        self.fused_decoder = None
        self.fused_steps = 0  # decode steps it ran (tests and benchmarks check it is used)
        self.fused_prompt_steps = 0  # and steps with prompt chunks
        if self.eagle is not None and config.fused_decode:
            logger.info(
                "fused decode step: off (an EAGLE-3 or MTP head reads hidden states it does not keep)"
            )
        elif config.fused_decode and self.native_kernels and hasattr(self.model, "fused_decoder"):
            rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
            self.fused_decoder, why = self.model.fused_decoder(self.kv_caches, rows)
            if self.fused_decoder is None:
                logger.info("fused decode step: off (%s)", why)
            elif why := self.fused_decoder.attach_head(self.model):
                logger.info("fused decode step: logits by the LM head module (%s)", why)
            draft = self.drafter
            if draft is not None and hasattr(draft.model, "fused_decoder"):
                draft.fused_decoder, why = draft.model.fused_decoder(draft.kv_caches, rows)
                if draft.fused_decoder is None:
                    logger.info("draft model's fused decode step: off (%s)", why)
        self.sampler = Sampler(device, config.seed)
        # async scheduling: the last step's sampled tokens, where the next step's inputs read them
        self.inflight = InflightTokens(config.max_num_seqs, device) if config.async_steps(device) else None
        self.draft_sampling = DraftSampling(self.sampler)  # drafts chosen, their q rows kept
        self.pooler = Pooler()  # embedding requests' running sums (runtime/pooler.py)
        # The persistent batch (runtime/persistent_batch.py): a copy of each held request.
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        others = [x for x in (self.pooler, self.drafter, self.eagle, self.medusa) if x is not None]
        self.batch = PersistentBatch(config.max_num_seqs, self.max_blocks_per_seq, others, self._table_grew)
        self.sequences = self.batch.sequences
        self.inputs = BatchInputs(
            self.batch.table,
            self.block_size,
            self.max_blocks_per_seq,
            self.attention,
            device,
            dtype,
            self.inflight,
        )
        pools = list(self.kv_caches)  # every pool that shares the block ids moves with a block
        pools += self.drafter.kv_caches if self.drafter is not None else []
        pools += [self.eagle.kv_cache] if self.eagle is not None and self.eagle.kv_cache is not None else []
        self.kv_connector = make_worker_connector(config, model_path, dtype, device, parallel, pools)
        if graphs:
            rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
            self.fused_decoder = self._cuda_graphs(rows)

    @classmethod
    def from_spec(cls, spec: RunnerSpec) -> ModelRunner:
        return cls(
            spec.config,
            spec.model_config,
            spec.model_path,
            spec.device,
            spec.dtype,
            spec.max_model_len,
            spec.progress,
            spec.parallel,
            spec.local_ranks,
        )

    def _cuda_graphs(self, rows: int) -> CudaGraphDecoder | None:
        """Decode steps from CUDA graphs, or None (logged) where the model cannot be captured."""
        why = None
        if self.expert_load is not None:
            why = "Mixture-of-Experts layers group tokens by expert on the host"
        elif self.eagle is not None:
            why = "an EAGLE-3 or MTP head reads hidden states the graphs do not keep"
        if why:
            logger.info("CUDA graphs: off (%s)", why)
            return None
        decoder = CudaGraphDecoder(
            self.model,
            self.kv_caches,
            self.attention,
            self.batch.table.mirror(self.device),  # the graphs read the table there, by seat
            rows,
            self.block_size,
            self.num_blocks * self.block_size,
            self.device,
            self.inflight.device_buffer if self.inflight is not None else None,
        )
        decoder.capture()
        return decoder

    def _table_grew(self) -> None:
        """More requests held than max_num_seqs seats: the table was replaced under the graphs."""
        if isinstance(self.fused_decoder, CudaGraphDecoder):
            logger.warning("CUDA graphs: off (more requests held than max_num_seqs seats)")
            self.fused_decoder = None  # the graphs read the table the growth replaced

    # -- one step -------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        connector = self.kv_connector
        if connector is not None:
            connector.start(plan.kv_transfer)
        result = self._execute(plan)
        if connector is not None:
            result.kv_loaded = connector.finish(idle=plan.empty)
        if self.expert_load is not None:
            result.moe_expert_tokens = self.expert_load.after_step(ran_model=not plan.empty)
        return result

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Async scheduling's step: queue the plan's work on the device and return at once;
        the result waits for the sampled tokens. Inputs may read the last launched step's
        tokens on the device. Only for plans of overlappable requests (sampling_params.overlappable),
        without drafts or a KV connector; results must be taken in launch order."""
        if self.inflight is None:
            raise RuntimeError("this runner was built without async scheduling")
        launched = self._execute(plan, ahead=True)
        if not isinstance(launched, LaunchedStep):
            launched = LaunchedStep(launched)
        if self.expert_load is not None:
            launched.partial.moe_expert_tokens = self.expert_load.after_step(ran_model=not plan.empty)
        return launched

    def close(self) -> None:
        """Finish what must outlive the process (a disk tier's pending writes)."""
        if self.kv_connector is not None:
            self.kv_connector.close()

    def _execute(self, plan: StepPlan, ahead: bool = False) -> StepResult | LaunchedStep:
        self.batch.apply_diff(plan)
        if plan.empty:
            return StepResult()
        drafts = plan.draft_token_ids
        asked = [(rid, self.sequences[rid], len(d)) for rid, d in drafts.items() if DRAFTED_BY_RUNNER in d]
        if asked:  # slots the draft model or head fills in
            if self.drafter is not None:
                inputs, choose = self.inputs, self.draft_sampling.choose
                found = self.drafter.propose(asked, inputs.prepare, inputs.fused_decode, choose)
            elif self.medusa is not None:
                found = self.medusa.propose(asked, self.draft_sampling.choose)
            else:
                assert self.eagle is not None, "draft slots without a draft model or head"
                found = self.eagle.propose(asked, self.inputs.prepare, self.draft_sampling.choose)
            drafts = {**drafts, **found}
        for rid, found in drafts.items():  # computed like the request's own tokens, then checked
            self.sequences[rid].token_ids.extend(found)
        # A decode and its drafts become rows of one token each, at successive positions: the
        # step writes every row's key and value before any row attends, so the row at position
        # p sees the drafts before it in the cache, and a window verifies as decodes do (the
        # decode attention kernel, the fused step) instead of as a short prefill chunk.
        scheduled = [(rid, self.sequences[rid], n) for rid, n in plan.num_scheduled_tokens.items()]
        decodes: list[tuple[str, RunnerSequence, int]] = []  # (request, its copy, context before the row)
        chunks: list[tuple[str, RunnerSequence, int]] = []  # (request, its copy, tokens in the chunk)
        for rid, seq, n in scheduled:
            if n == 1 and not (drafts and rid in drafts):  # a plain decode: most rows, most steps
                decodes.append((rid, seq, seq.num_computed_tokens))
            elif n == 1 + len(drafts.get(rid, ())):
                decodes.extend((rid, seq, seq.num_computed_tokens + i) for i in range(n))
            else:
                chunks.append((rid, seq, n))
        # Decodes sorted by length, so similar lengths share a padded attention group.
        decodes.sort(key=lambda x: x[2])
        # The flat rows of each request's positions, in position order (the sort is stable).
        rows_of: dict[str, list[int] | range]
        if drafts:
            rows_of = {}
            for i, (rid, _, _) in enumerate(decodes):
                rows_of.setdefault(rid, []).append(i)
        else:  # a row per request
            rows_of = {rid: [i] for i, (rid, _, _) in enumerate(decodes)}
        offset = len(decodes)
        for rid, _, n in chunks:
            rows_of[rid] = range(offset, offset + n)
            offset += n
        fused = self.fused_decoder
        sampled_rows = None  # with prompt chunks: the only rows of `hidden` computed, in order
        if chunks and not drafts and self._reads_only_sampled_rows(scheduled):
            sampled_rows = [rows_of[rid][-1] for rid, seq, n in scheduled if seq.samples_after(n)]
        hidden = None
        step_logits = greedy = None  # where the fused decode step computed the logits too
        if fused is not None and not chunks and len(decodes) <= fused.max_rows:
            hidden = self.inputs.fused_decode(fused, [(seq, ctx) for _, seq, ctx in decodes])
            self.fused_steps += 1
            if isinstance(fused, FusedDecoder):
                step_logits, greedy = fused.logits, fused.argmax
        elif isinstance(fused, FusedDecoder) and chunks and not drafts and self.drafter is None:
            if offset <= fused.prompt_rows:  # the step's rows
                hidden = self.inputs.fused_step(
                    fused,
                    [(seq, ctx) for _, seq, ctx in decodes],
                    [(seq, seq.num_computed_tokens, n) for _, seq, n in chunks],
                    sampled_rows,
                )
                self.fused_prompt_steps += hidden is not None
        if hidden is None:
            entries = [(seq, ctx, 1) for _, seq, ctx in decodes]
            entries += [(seq, seq.num_computed_tokens, n) for _, seq, n in chunks]
            input_ids, positions, meta = self.inputs.prepare(entries, len(decodes))
            if sampled_rows is not None:
                keep = torch.tensor(sampled_rows, dtype=torch.long).to(self.device, non_blocking=True)
                hidden = self.model(input_ids, positions, self.kv_caches, meta, keep)
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            if self.drafter is not None and chunks:  # prompts reach the draft model with the target
                spans = [(rid, ctx, 1) for rid, _, ctx in decodes]
                spans += [(rid, seq.num_computed_tokens, n) for rid, seq, n in chunks]
                self.drafter.follow(input_ids, positions, meta, spans)
        # where each request's positions start, for the EAGLE head's catch-up after sampling
        first_position = {rid: seq.num_computed_tokens for rid, seq, _ in scheduled} if self.eagle else {}
        # Embedding requests: pooled from the final hidden states; they never sample.
        embeddings = self.pooler.step(scheduled, rows_of, hidden)
        sample_index, rows, ids = [], [], []
        grammar_rows: dict[str, int] = {}  # a request's first row; its drafted positions follow
        for i, rid in enumerate(plan.grammar_request_ids):
            grammar_rows.setdefault(rid, i)
        for rid, seq, n in scheduled:
            samples = seq.samples_after(n)
            seq.num_computed_tokens += n
            if not samples:  # a prefill chunk short of the prompt's end, or an embedding
                continue
            k = len(drafts[rid]) if drafts and rid in drafts else 0
            if not k and not grammar_rows:  # the common row, without the general case's lists
                sample_index.append(rows_of[rid][-1])
                if seq.plain_row is None:  # it reads token_ids, the list itself: valid for good
                    seq.plain_row = sampling_row(seq, None)
                rows.append(seq.plain_row)
                ids.append(rid)
                continue
            window = rows_of[rid][-(k + 1) :]
            # Every drafted position is sampled as if its drafts were the request's own tokens.
            for i in range(k + 1):
                sample_index.append(window[i])
                first = grammar_rows.get(rid)
                grammar_row = None if first is None else first + i
                rows.append(sampling_row(seq, grammar_row, len(seq.token_ids) - k + i))
                ids.append(rid)
        if not rows:
            return StepResult(embeddings=embeddings)
        if sampled_rows is not None:  # the model computed these rows alone, in this order
            assert sample_index == sampled_rows, "sampled rows foreseen wrongly"
            logits = self.model.compute_logits(hidden)
        elif sample_index == list(range(hidden.shape[0])):  # a plain decode step samples every row
            logits = step_logits if step_logits is not None else self.model.compute_logits(hidden)
        else:
            index = torch.tensor(sample_index, pin_memory=self.device.type == "cuda")
            if step_logits is not None:
                logits = step_logits.index_select(0, index)
                greedy = [greedy[i] for i in sample_index]  # type: ignore[index]
            else:
                logits = self.model.compute_logits(
                    hidden.index_select(0, index.to(self.device, non_blocking=True))
                )
        bitmask = None
        if plan.grammar_bitmask is not None:
            words = torch.frombuffer(bytearray(plan.grammar_bitmask), dtype=torch.int32)
            bitmask = words.view(len(plan.grammar_request_ids), -1)
        result = StepResult(embeddings=embeddings)
        # Windows of drafts sampled from the draft model's distribution are verified by
        # rejection sampling; every other row is sampled, and its drafts checked against that.
        sampled_drafts = self.draft_sampling.probs
        if not drafts and not sampled_drafts and self.medusa is None and self.eagle is None:
            # a row per request, no window to check, no head to feed
            if ahead:
                wait = self.inflight.publish(self.sampler.sample_tensor(logits, rows))  # type: ignore[union-attr]
                for i, rid in enumerate(ids):
                    seq = self.sequences[rid]
                    seq.pending += 1
                    seq.inflight = i
                return LaunchedStep(result, ids, wait, self.batch.deliver)
            for rid, sampled in zip(ids, self.sampler(logits, rows, bitmask, greedy)):
                result.sampled[rid] = [sampled.token_id]
                if sampled.logprobs is not None:
                    result.logprobs[rid] = [sampled.logprobs]
                self.sequences[rid].token_ids.append(sampled.token_id)
            self.draft_sampling.probs = {}
            return result
        plain = [i for i, rid in enumerate(ids) if rid not in sampled_drafts]
        chosen = []
        if plain:
            some = logits[plain] if len(plain) < len(ids) else logits
            chosen = self.sampler(some, [rows[i] for i in plain], bitmask)
        for i, sampled in zip(plain, chosen):
            rid = ids[i]
            result.sampled.setdefault(rid, []).append(sampled.token_id)
            if sampled.logprobs is not None:
                result.logprobs.setdefault(rid, []).append(sampled.logprobs)
        for rid, q in sampled_drafts.items():
            at = [i for i, r in enumerate(ids) if r == rid]
            kept, logprobs = self.draft_sampling.verify(
                self.sequences[rid], drafts[rid], q, logits[at], [rows[i] for i in at]
            )
            result.sampled[rid] = kept
            if logprobs is not None:
                result.logprobs[rid] = logprobs
        self.draft_sampling.probs = {}
        for rid, tokens in result.sampled.items():
            seq = self.sequences[rid]
            found = drafts.get(rid)
            if found:
                kept = tokens if rid in sampled_drafts else accepted_tokens(found, tokens)
                del seq.token_ids[len(seq.token_ids) - len(found) :]
                seq.num_computed_tokens = len(seq.token_ids) - 1 + len(kept)
                result.sampled[rid] = tokens = kept
                if rid in result.logprobs:
                    del result.logprobs[rid][len(kept) :]
                if self.drafter is not None:
                    self.drafter.checked(rid, seq.num_computed_tokens)
            seq.token_ids.extend(tokens)
        if self.medusa is not None:  # the state that gave each request's last token
            last_rows = []
            for rid, tokens in result.sampled.items():
                window = rows_of[rid][-(len(drafts.get(rid, ())) + 1) :]
                last_rows.append((rid, self.sequences[rid], window[len(tokens) - 1]))
            self.medusa.keep(last_rows, hidden)
        features = None
        if self.eagle is not None:  # MTP reads the final hidden states, EAGLE-3 captured layers
            features = hidden if self.eagle.head.reads_final_hidden else self.model.captured
        if self.eagle is not None and features is not None:
            # the head over what the target kept: every chunk position, a window's accepted part
            spans = []
            for rid, seq, n in scheduled:
                kept = len(result.sampled.get(rid, ())) if rid in drafts else n
                spans.append((rid, seq, first_position[rid], kept, rows_of[rid][:kept]))
            self.eagle.follow(spans, features, self.inputs.prepare)
        return result

    def _reads_only_sampled_rows(self, scheduled: list[tuple[str, RunnerSequence, int]]) -> bool:
        """Whether this step reads the final hidden states of its sampled rows alone: not where a
        speculative head follows every position or an embedding request pools them."""
        if self.eagle is not None or self.medusa is not None:
            return False
        return all(seq.params.pooling is None for _, seq, _ in scheduled)

    @torch.inference_mode()
    def prompt_logits(
        self, token_ids: list[int], num_computed: int, num_new: int, block_ids: list[int]
    ) -> torch.Tensor:
        """Logits at every position of one prefill chunk: what scoring a text needs.

        Runs outside the persistent batch (the engine is idle), on blocks the caller holds.
        """
        seq = RunnerSequence(token_ids, len(token_ids), SamplingParams(), None, [], 0, -1, num_computed)
        table = torch.tensor([block_ids], dtype=torch.long)
        ids, positions, meta = self.inputs.prepare([(seq, num_computed, num_new)], 0, table)
        if self.expert_load is not None:
            self.expert_load.note_pass()
        return self.model.compute_logits(self.model(ids, positions, self.kv_caches, meta))
