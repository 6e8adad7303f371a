"""The synchronous engine: add requests, call step() until done, read outputs.

One step = schedule -> run the model -> update request state -> detokenize -> outputs.
An `n > 1` request is fanned out into n sequences that share the prompt's KV blocks
through the prefix cache (the first admitted computes them; the others hit them, in the
same step if need be) and is reported back as one output with n completions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from dolmus.config import EngineConfig, ModelConfig, SpeculativeConfig
from dolmus.engine import engine_report
from dolmus.engine.admission import AdmissionControl, RequestRefused, kv_fetch_failed, queue_timeout
from dolmus.engine.detokenizer import IncrementalDetokenizer
from dolmus.engine.kv_setup import build_kv_side, fit_max_model_len
from dolmus.engine.request import Request, RequestStatus
from dolmus.engine.request_group import CHILD_SEP, RequestGroup
from dolmus.engine.scheduler import Scheduler, SchedulerOutput
from dolmus.engine.stats import EngineStats, RequestSummary
from dolmus.engine.tokenizing import load_tokenizer, tokenize_prompt
from dolmus.executor import Executor, WorkerDiedError, make_executor
from dolmus.outputs import RequestOutput
from dolmus.runtime import native
from dolmus.runtime.cpu_profile import cpu_profile
from dolmus.runtime.inflight import LaunchedStep
from dolmus.runtime.model_runner import ModelRunner
from dolmus.runtime.runner_spec import RunnerSpec
from dolmus.sampling_params import SamplingParams, overlappable
from dolmus.step import StepPlan, StepResult
from dolmus.structured.backend import GrammarCache, make_backend, step_bitmask

logger = logging.getLogger(__name__)


class Engine:
    """Schedules, runs steps through an executor, and turns their results into outputs.

    `executor` is for tests that drive the engine with a runner of their own; by default the
    config's executor is built (in this process, or worker processes).
    """

    def __init__(
        self, config: EngineConfig | None = None, progress: bool = False, executor: Executor | None = None
    ) -> None:
        self.config = config = config or EngineConfig()
        path = config.model_path
        self.model_config = mc = ModelConfig.from_dir(path)
        self.device = config.resolve_device()
        if self.device.type == "cpu":
            cpu_profile()  # decided (and logged, in one line) before any kernel is chosen
        self.dtype = config.resolve_dtype(mc.dtype, self.device, native.cpu_has_bf16())
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and not native.cpu_has_bf16():
            logger.warning(
                "dtype bfloat16: this CPU has no bf16 arithmetic (AVX-512 BF16, AMX), so every product "
                "is emulated and slow; --dtype auto runs a bf16 checkpoint in float32 on our kernels, "
                "its weights kept in bf16"
            )
        self.max_model_len = self._resolve_max_model_len(mc)
        self.tokenizer = load_tokenizer(str(config.tokenizer or path))
        spec = RunnerSpec(config, mc, path, self.device, self.dtype, self.max_model_len, progress)
        self.executor = executor or make_executor(spec)
        num_blocks = self.executor.info.num_blocks
        self._kv_events, self.kv, self.connector = build_kv_side(config, mc.kv_window, self.executor)
        budget = config.resolve_batched_tokens(self.device, self.executor.info.step_tokens)
        self.max_model_len = fit_max_model_len(
            self.max_model_len, num_blocks, config.block_size, self.kv.window, budget
        )
        speculative = config.speculative_config
        assert speculative is None or isinstance(speculative, SpeculativeConfig)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            budget,
            self.max_model_len,
            config.tier_specs,
            speculative,
            self.connector,
            None if config.itl_target_ms is None else config.itl_target_ms / 1e3,
        )
        self.admission = AdmissionControl(self.scheduler.book, budget)
        self._refusals: list[tuple[str, RequestRefused]] = []  # since take_refusals() last ran
        self.counters = engine_report.EngineCounters()
        backend = config.structured_output_backend
        self.grammars = GrammarCache(
            lambda: make_backend(backend, self.tokenizer, mc.vocab_size, mc.eos_token_ids)
        )
        self._groups: dict[str, RequestGroup] = {}
        self._owner: dict[str, str] = {}  # sequence id -> user request id
        # whether an MoE model ran since its routed-token counts were last reported (the runner
        # reports now and then: runtime/expert_load.py)
        self._moe_unreported = False
        # Async scheduling: the step launched and not yet taken in (its plan, its handle, when
        # it started), and how many requests need steps one at a time meanwhile.
        self._ahead = (
            config.async_steps(self.device)
            and self.executor.can_launch
            and speculative is None
            and self.connector is None
        )
        self._launched: tuple[SchedulerOutput, LaunchedStep, float, int] | None = None
        self._one_at_a_time = 0
        self._last_done = 0.0
        if self._ahead:
            logger.info("async scheduling: on (a step is launched before the last one's tokens are read)")

    @property
    def runner(self) -> ModelRunner:
        """The model runner, where it lives in this process (tests and benchmarks look inside)."""
        runner = getattr(self.executor, "runner", None)
        if runner is None:
            raise AttributeError("the model runs in worker processes: no runner in this process")
        return runner

    def is_healthy(self) -> bool:
        try:
            self.executor.check_health()
        except WorkerDiedError:
            return False
        return True

    def shutdown(self) -> None:
        """Stop the executor's workers (if any) and the KV event publisher (if any); the engine
        is unusable afterwards."""
        self.abort_all()
        self.executor.shutdown()
        if self._kv_events is not None:
            self._kv_events.close()
        if self.connector is not None:
            self.connector.close()

    def _resolve_max_model_len(self, mc: ModelConfig) -> int:
        limit = mc.max_position_embeddings
        length = self.config.max_model_len or limit
        if length > limit:
            raise ValueError(f"max_model_len {length} exceeds the model's context length {limit}")
        return length

    # -- requests -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError naming the field if anything is wrong."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        prompt_text, prompt_ids = tokenize_prompt(self.tokenizer, prompt, self.model_config.vocab_size)
        # An embedding generates nothing: its prompt may fill the whole context.
        room = self.max_model_len - len(prompt_ids) + (params.pooling is not None)
        if room < 1:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = arrival_time or time.monotonic()
        sched = self.scheduler
        priority = self.admission.admit(priority, len(prompt_ids), sched.waiting.demand, sched.running)
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child_id = request_id if params.n == 1 else f"{request_id}{CHILD_SEP}{i}"
            children.append(
                Request(
                    child_id,
                    prompt_ids,
                    params,
                    self.model_config.eos_token_ids,
                    max_tokens,
                    priority,
                    arrival,
                    seed,
                )
            )
        for child in children:
            if child.request_id in self._owner:
                raise ValueError(f"request_id {child.request_id!r} is already in use")
        if params.structured_output is not None:
            for child in children:  # compiled once (cached); a bad spec raises ValueError here
                child.grammar = self.grammars.new_state(params.structured_output)
            self.counters.structured_requests += 1
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_ids, params) for _ in children]
        one_at_a_time = not all(overlappable(params, child.seed) for child in children)
        self._groups[request_id] = RequestGroup(
            request_id, prompt_text, prompt_ids, children, detoks, one_at_a_time
        )
        self._one_at_a_time += one_at_a_time
        for child in children:
            self._owner[child.request_id] = request_id
            self.scheduler.add(child)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown ids are ignored."""
        group = self._forget(request_id)
        if group is None:
            return
        for child in group.children:
            if not child.status.finished:
                self.scheduler.finish(child.request_id, RequestStatus.FINISHED_ABORTED)
                self.counters.count_finished(child)

    def abort_all(self) -> None:
        for request_id in list(self._groups):
            self.abort_request(request_id)
        self._take_launched()  # nothing left in flight: the engine is idle

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (SGLang's /flush_cache, vLLM's reset_prefix_cache): a
        clean slate for a benchmark or after swapping what the weights mean. Only while idle,
        as both engines do; False, changing nothing, while any request is in the engine."""
        if self.has_unfinished_requests() or not self.kv.forget_all():
            return False
        self._publish_kv_events()  # AllBlocksCleared: routers forget this replica's blocks
        return True

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # -- the loop -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step, and the cumulative output of each request it moved on."""
        return [group.output() for group in self.step_groups()]

    def step_groups(self) -> list[RequestGroup]:
        """One step: schedule, run, and take in what it sampled. Returns the requests it moved
        on (finished ones already released), each read by its caller one way: `output()`
        (cumulative, as `step` does) or `delta()` (what is new, as the engine core sends).
        Under async scheduling a step is launched and what is taken in is the previous step's."""
        if self._ahead and not self._one_at_a_time:
            return self._step_ahead()
        if self._launched is not None:  # a request that needs steps one at a time came in
            return self._take_launched()
        start = time.monotonic()
        self._refuse_overdue(start)
        sched = self.scheduler.schedule()
        prefill_tokens = engine_report.prefill_tokens(sched, advanced=False)
        self._attach_grammar_bitmask(sched)
        result = self.executor.execute(sched.plan)
        return self._complete(sched, result, start, prefill_tokens, ahead=False)

    def _step_ahead(self) -> list[RequestGroup]:
        """Schedule and launch step N+1 (its decodes' inputs are step N's tokens, still on the
        device), then take in step N while the device runs N+1: the host's appending, stop
        checks and detokenizing overlap the device's work."""
        start = time.monotonic()
        self._refuse_overdue(start)
        sched = self.scheduler.schedule(ahead=True)
        prefill_tokens = engine_report.prefill_tokens(sched, advanced=True)
        launched = self.executor.launch(sched.plan)
        groups = self._take_launched()
        self._launched = (sched, launched, start, prefill_tokens)
        if not self._groups:  # all finished: what was just launched is rows past their ends
            groups += self._take_launched()
        return groups

    def _take_launched(self) -> list[RequestGroup]:
        """Wait for the launched step's tokens and take them in ([] if none)."""
        if self._launched is None:
            return []
        sched, launched, start, prefill_tokens = self._launched
        self._launched = None
        # its own span: from its launch, or from the last step's end where the two overlapped
        return self._complete(
            sched, launched.result(), max(start, self._last_done), prefill_tokens, ahead=True
        )

    def _complete(
        self, sched: SchedulerOutput, result: StepResult, start: float, prefill_tokens: int, ahead: bool
    ) -> list[RequestGroup]:
        self._moe_unreported |= bool(self.model_config.num_experts) and not sched.plan.empty
        self._take_expert_load(result)
        updated = self.scheduler.update(sched, result, ahead)
        self._fail_transfers()

        touched: dict[str, RequestGroup] = {}
        ended: list[str] = []  # groups a sequence of which finished in this step
        for request, num_new in updated:
            group_id = self._owner.get(request.request_id)
            group = self._groups.get(group_id) if group_id is not None else None
            if group is None:
                continue
            index = group.children.index(request) if len(group.children) > 1 else 0
            if request.embedding is not None:  # an embedding: no tokens, no text
                self.counters.prompt_tokens += request.num_prompt_tokens
                self.counters.count_finished(request)
                touched[group_id] = group
                ended.append(group_id)
                continue
            if request.num_output_tokens == num_new:
                self.counters.prompt_tokens += request.num_prompt_tokens
            detok = group.detoks[index]
            new_ids = request.output_token_ids[-num_new:]
            # The EOS or stop token that ended a request is in its token ids but not its text
            # (as vLLM), even where special tokens are shown, unless include_stop_str_in_output.
            ended_by_token = (
                request.status is RequestStatus.FINISHED_STOPPED
                and new_ids[-1] in request.stop_token_ids
                and not request.params.include_stop_str_in_output
            )
            stop = detok.add_tokens(new_ids[:-1] if ended_by_token else new_ids)
            consumed = detok.num_consumed + (1 if ended_by_token and stop is None else 0)
            self.counters.generation_tokens += consumed
            if stop is not None:
                request.drop_last_outputs(num_new - consumed)
                request.stop_reason = stop
                if request.status.finished:  # the same token also hit a length limit
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
            if request.status.finished:
                self.counters.count_finished(request)
                ended.append(group_id)
            touched[group_id] = group
        for group_id in ended:
            if touched[group_id].finished:
                self._forget(group_id)
        if self.connector is not None and not self._groups and self.connector.has_pending:
            # Going idle: the last step's saves (a disk tier's newest blocks) go now, not whenever
            # the next request comes.
            self._run_transfers()
        self._flush_expert_load()
        self._publish_kv_events()
        self._last_done = time.monotonic()
        elapsed = self._last_done - start
        self.counters.account_busy(elapsed, prefill_tokens, sched.num_batched_tokens)
        self.admission.observe_step(elapsed, sched.num_batched_tokens)
        self.scheduler.observe_step(sched, elapsed)
        return list(touched.values())

    def _refuse_overdue(self, now: float) -> None:
        """Requests that waited past their tier's max_queue_wait leave with a refusal."""
        for request in self.scheduler.overdue(now):
            group_id = self._owner.get(request.request_id)
            if group_id is None:
                continue
            self.counters.count_finished(request)
            self.abort_request(group_id)  # its other sequences, if n > 1
            self.counters.queue_timeouts += 1
            spec = self.scheduler.book.spec_for(request.priority)
            wait = spec.max_queue_wait if spec is not None else 0.0
            self._refusals.append((group_id, queue_timeout(now - request.timings.arrival, wait)))

    def _run_transfers(self) -> None:
        """A step of transfers only, outside the step loop; loads it sees end are applied."""
        assert self.connector is not None
        result = self.executor.execute(StepPlan(kv_transfer=self.connector.take_transfer()))
        self._take_expert_load(result)
        self.scheduler.apply_load_report(result.kv_loaded)

    def _take_expert_load(self, result: StepResult) -> None:
        if result.moe_expert_tokens is not None:
            self.counters.moe_expert_tokens = result.moe_expert_tokens
            self._moe_unreported = False

    def _flush_expert_load(self) -> None:
        """Going idle after running an MoE model: an empty plan brings the runner's latest
        expert counts, so the stats are exact whenever nothing runs (one message per idle spell)."""
        if self._moe_unreported and not self._groups:
            self._take_expert_load(self.executor.execute(StepPlan()))
            self._moe_unreported = False

    def _fail_transfers(self) -> None:
        """Requests whose prompt KV could not be fetched from their prefill worker end with an
        error naming it (kv_load_failure_policy "fail")."""
        for outcome in self.scheduler.take_failed_loads():
            request = outcome.request
            group_id = self._owner.get(request.request_id)
            if group_id is None:
                continue
            self.abort_request(group_id)
            self._refusals.append((group_id, kv_fetch_failed(outcome.source)))

    def _publish_kv_events(self) -> None:
        """One batch per step that changed the prefix cache, as vLLM sends (none when idle)."""
        if self._kv_events is not None:
            records = self.kv.take_events()
            if records:
                self._kv_events.publish(records)

    def take_refusals(self) -> list[tuple[str, RequestRefused]]:
        """Requests the engine dropped since the last call, with why (each is gone from it)."""
        refusals, self._refusals = self._refusals, []
        return refusals

    def _attach_grammar_bitmask(self, sched: SchedulerOutput) -> None:
        """Allowed tokens of each constrained request that samples this step, as plain data."""
        rows = [
            (s.request.request_id, s.request.grammar, s.drafts)
            for s in sched.scheduled
            if s.request.grammar is not None and s.samples
        ]
        if rows:
            bitmask, ids = step_bitmask(rows, self.model_config.vocab_size)
            sched.plan.grammar_bitmask, sched.plan.grammar_request_ids = bitmask, ids

    def _forget(self, request_id: str) -> RequestGroup | None:
        group = self._groups.pop(request_id, None)
        if group is not None:
            self._one_at_a_time -= group.one_at_a_time
            for child in group.children:
                self._owner.pop(child.request_id, None)
        return group

    # -- scoring --------------------------------------------------------------------------

    def prompt_logprobs(self, token_ids: Sequence[int], chunk_size: int | None = None) -> torch.Tensor:
        """Log-probabilities of the next token at every position of `token_ids`: [len, vocab].

        For perplexity and quality checks; runs prefill outside the step loop, so the engine
        must be idle. With `chunk_size`, the text goes through in chunks that read the
        earlier ones back from the KV cache (chunk_size=1 scores the way decoding reads),
        so a quantized cache shows in the result.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("prompt_logprobs needs an idle engine")
        _, ids = tokenize_prompt(self.tokenizer, token_ids, self.model_config.vocab_size)
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed max_model_len={self.max_model_len}")
        request = Request("score", ids, SamplingParams(max_tokens=1), [], 1)
        if self.connector is not None and self.connector.has_pending:
            self._run_transfers()  # the blocks to save leave before the scoring may overwrite them
        if not self.kv.allocate(request, len(ids)):
            raise ValueError("the KV cache cannot hold this many tokens at once")
        if self.kv.pool.evicted:  # overwritten by the scoring below, before any step could save them
            self.kv.pool.evicted.clear()
        step = chunk_size or len(ids)
        table = self.kv.block_ids("score")
        chunks = []
        try:
            for start in range(0, len(ids), step):
                chunks.append(self.executor.prompt_logits(ids, start, min(step, len(ids) - start), table))
            self.kv.commit_step()
        finally:
            self.kv.free(request)
            self._publish_kv_events()  # the scored prompt's blocks stay cached
        self._moe_unreported = bool(self.model_config.num_experts)
        self._flush_expert_load()
        logits = torch.cat(chunks)
        return torch.log_softmax(logits.float(), dim=-1)

    # -- observability ----------------------------------------------------------------

    def request_summaries(self) -> list[RequestSummary]:
        """Every sequence still in the engine, most urgent first."""
        return engine_report.request_summaries(self.scheduler, self.kv)

    def stats(self) -> EngineStats:
        return engine_report.engine_stats(
            self.counters,
            self.scheduler,
            self.kv,
            self.admission,
            self.executor.info,
            self.config.block_size,
            self.connector,
        )
