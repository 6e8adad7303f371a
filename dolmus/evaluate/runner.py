"""Runs one model over a task set: greedy answers (all prompts submitted at once so continuous
batching works), the log-likelihood of each reference under the model (scored with
Engine.prompt_logprobs on prompt+reference), throughput and weight memory."""

from __future__ import annotations

import gc
import time
from typing import Any

from dolmus.config import EngineConfig
from dolmus.engine.engine import Engine
from dolmus.engine.tokenizing import tokenize_prompt
from dolmus.entrypoints.chat_utils import render_chat
from dolmus.entrypoints.llm import LLM
from dolmus.evaluate.tasks import Task, score
from dolmus.sampling_params import SamplingParams


def run_model(config: EngineConfig, tasks: list[Task]) -> dict[str, Any]:
    engine = Engine(config)
    try:
        tok, vocab = engine.tokenizer, engine.model_config.vocab_size
        prompts = [
            render_chat(tok, t.messages)
            if t.messages is not None
            else tokenize_prompt(tok, t.prompt, vocab)[1]
            for t in tasks
        ]
        params = [SamplingParams(temperature=0.0, max_tokens=t.max_tokens) for t in tasks]
        start = time.perf_counter()
        outs = LLM(engine=engine).generate(prompts, params)
        seconds = time.perf_counter() - start
        answers = [o.outputs[0].text for o in outs]
        n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        ref_lls: list[list[float]] = []
        for t, p in zip(tasks, prompts):
            ref = tok.encode(t.reference, add_special_tokens=False) if t.reference else []
            if not ref:
                ref_lls.append([])
                continue
            lp = engine.prompt_logprobs(list(p) + ref)
            # Row i holds the distribution of token i+1, so reference token j sits at row len(p)-1+j.
            ref_lls.append([float(lp[len(p) - 1 + j, r]) for j, r in enumerate(ref)])
        weight_bytes = engine.stats().weight_bytes
    finally:
        engine.shutdown()
        del engine
        gc.collect()  # free this model before the next one loads
    return {
        "answers": answers,
        "correct": [score(t, a) for t, a in zip(tasks, answers)],
        "ref_logprobs": ref_lls,
        "tokens_per_s": n_tokens / seconds if seconds > 0 else 0.0,
        "generated_tokens": n_tokens,
        "weight_bytes": weight_bytes,
    }
