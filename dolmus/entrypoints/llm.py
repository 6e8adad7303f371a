"""The offline Python API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from dolmus.config import EngineConfig
from dolmus.engine.engine import Engine
from dolmus.entrypoints.chat_utils import render_chat
from dolmus.outputs import RequestOutput
from dolmus.pooling_params import PoolingParams
from dolmus.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Runs many prompts at once through one engine and returns when all are done."""

    def __init__(
        self,
        model: str | None = None,
        progress: bool = False,
        engine: Engine | None = None,
        **engine_args: Any,
    ) -> None:
        """`engine`: run on an engine built elsewhere (say, with an executor of one's own)."""
        self.engine = engine or Engine(EngineConfig(model=model, **engine_args), progress=progress)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        n = len(prompt_list)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * n
        else:
            params_list = list(sampling_params)
            if len(params_list) != n:
                raise ValueError(f"sampling_params has {len(params_list)} entries for {n} prompts")
        priorities = list(priority) if priority is not None else [0] * n
        if len(priorities) != n:
            raise ValueError(f"priority has {len(priorities)} entries for {n} prompts")

        ids = [f"gen-{next(self._ids)}" for _ in range(n)]
        added: list[str] = []
        try:
            for rid, prompt, params, prio in zip(ids, prompt_list, params_list, priorities):
                self.engine.add_request(rid, prompt, params, prio)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None
    ) -> list[list[float]]:
        """One vector per prompt: its final hidden states pooled (last token, normalized by
        default; pooling_params.py), batched through the scheduler like any prompt."""
        params = SamplingParams(max_tokens=1, pooling=pooling or PoolingParams())
        outputs = self.generate(prompts, params)
        return [out.embedding or [] for out in outputs]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            render_chat(self.tokenizer, conv, chat_template, add_generation_prompt) for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req")
        wanted = set(ids)
        while wanted - done.keys():
            # Only finished requests' outputs are built: a cumulative output is O(length).
            for group in self.engine.step_groups():
                if group.finished and group.request_id in wanted:
                    done[group.request_id] = group.output()
                    if bar is not None:
                        bar.update(1)
            for rid, refusal in self.engine.take_refusals():  # a tier's max_queue_wait passed
                if rid in wanted:
                    for other in wanted - done.keys():
                        self.engine.abort_request(other)
                    raise refusal
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts
