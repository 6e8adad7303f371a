"""`dolmus run-batch -i in.jsonl -o out.jsonl`: a Batch API input file, offline, in-process.

The same JSONL as OpenAI's Batch API and vLLM's run-batch: each line `{"custom_id", "method",
"url", "body"}` with url /v1/chat/completions or /v1/completions, in one file. Lines go through
the very API modules the server uses (server/openai/batch_runner.py over an in-process engine),
so a line is checked and answered exactly as `dolmus serve` would answer it; output lines, failed
ones included (as vLLM writes them), come out in input order.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tqdm import tqdm

from dolmus.config import EngineConfig
from dolmus.engine.async_engine import AsyncEngine
from dolmus.engine.engine import Engine
from dolmus.server.model_names import ModelNames
from dolmus.server.openai.batch_runner import ENDPOINTS, BatchTarget, run_line
from dolmus.server.openai.chat import OpenAIChat
from dolmus.server.openai.completions import OpenAICompletions
from dolmus.server.serving_common import Serving


async def run_batch_file(
    engine_config: EngineConfig,
    input_path: str | Path,
    output_path: str | Path,
    served_model_name: str | None = None,
    chat_template: str | None = None,
) -> tuple[int, int]:
    """Answer every line of `input_path` into `output_path`: (succeeded, failed)."""
    text = Path(input_path).read_text(encoding="utf-8")
    lines = [line for line in text.split("\n") if line.strip()]
    local = await asyncio.to_thread(Engine, engine_config, True)
    engine = AsyncEngine(local)
    engine.start()
    try:
        names = ModelNames.for_model(engine_config.model, served_model_name)
        serving = Serving(engine, names, chat_template)
        target = BatchTarget(OpenAIChat(serving), OpenAICompletions(serving), 0, engine_config.max_num_seqs)
        slots = asyncio.Semaphore(target.max_in_flight)  # the engine's queue stays bounded
        progress = tqdm(total=len(lines), unit="req", desc="run-batch")

        async def one(index: int, raw: str) -> tuple[bool, dict]:
            async with slots:
                result = await run_line(target, ENDPOINTS, f"batch_req_{index}", raw)
            progress.update()
            return result

        results = await asyncio.gather(*(one(i, raw) for i, raw in enumerate(lines)))
        progress.close()
    finally:
        await engine.shutdown()
    with open(output_path, "w", encoding="utf-8") as f:
        for _, line in results:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    ok = sum(1 for good, _ in results if good)
    return ok, len(results) - ok
