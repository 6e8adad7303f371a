"""The load generator: send benchmark requests to an OpenAI-compatible server, timed.

Every request streams from /v1/completions; the client stamps the send time, each chunk that
chunk, and the end. Arrival processes: a fixed number of requests in flight
(closed loop), Poisson arrivals at a rate, bursts of N every T seconds, or a trace's own
timestamps at a chosen speed (open loop: a slow server does not slow the arrivals).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from dolmus.bench.dataset import BenchRequest

RECONNECT_TRIES = 8  # POSTs tried on closed keep-alive connections (`_post`)


@dataclass
class RequestResult:
    """One request as measured; times in seconds, `start` from the start of the run."""

    index: int
    start: float
    ok: bool
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    tier: str | None = None
    app: str | None = None
    queue_time: float | None = None  # known only in-process (replay)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot": self.tpot}


@dataclass(frozen=True)
class Load:
    """How requests arrive. kind: concurrency | rate | burst | trace."""

    kind: str
    value: float  # requests in flight, requests/s, burst size, or trace speed
    interval: float = 1.0  # seconds between bursts

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency {int(self.value)}"
        if self.kind == "rate":
            return f"rate {self.value:g}/s"
        if self.kind == "burst":
            return f"bursts of {int(self.value)} every {self.interval:g}s"
        return f"trace at {self.value:g}x"

    def send_times(self, requests: list[BenchRequest], seed: int = 0) -> list[float] | None:
        """When each request is sent (seconds from start); None for a closed loop."""
        n = len(requests)
        if self.kind == "concurrency":
            return None
        if self.kind == "rate":
            rng = random.Random(seed)
            t, times = 0.0, []
            for _ in range(n):
                times.append(t)
                t += rng.expovariate(self.value)
            return times
        if self.kind == "burst":
            size = int(self.value)
            return [(i // size) * self.interval for i in range(n)]
        if self.kind == "trace":
            if any(r.timestamp is None for r in requests):
                raise ValueError("trace arrivals need a timestamp on every request")
            first = requests[0].timestamp or 0.0
            return [((r.timestamp or 0.0) - first) / self.value for r in requests]
        raise ValueError(f"unknown arrival kind {self.kind!r}")


def validate_load(load: Load) -> Load:
    if load.kind not in ("concurrency", "rate", "burst", "trace"):
        raise ValueError(f"unknown arrival kind {load.kind!r}")
    if load.value <= 0 or (load.kind in ("concurrency", "burst") and load.value != int(load.value)):
        raise ValueError(f"{load.kind} must be a positive {'integer' if load.kind != 'rate' else 'number'}")
    if load.kind == "burst" and load.interval <= 0:
        raise ValueError("the burst interval must be positive")
    return load


class CompletionsClient:
    """Streams one benchmark request through /v1/completions and times it."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        ignore_eos: bool = True,
        temperature: float = 0.0,
        extra_body: dict[str, Any] | None = None,
        timeout: float = 600.0,
    ) -> None:
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.extra_body = extra_body or {}
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        # aiohttp, as vLLM's benchmark client: its C stream reader costs a fraction of httpx's
        # per chunk, and the load generator shares the machine's cores with the server.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _post(self, body: dict[str, Any], headers: dict[str, str]) -> aiohttp.ClientResponse:
        """POST, again if a pooled connection turns out closed (some servers, llama-server
        among them, close keep-alive connections after a response without saying so): the
        request could not be written, or the server hung up before answering a byte. As
        browsers do for a reused connection, the request is sent again; each failure drops
        one dead connection from the pool, so a few tries reach a live or a fresh one."""
        for _ in range(RECONNECT_TRIES - 1):
            try:
                return await self.session.post(self.url, json=body, headers=headers)
            except aiohttp.ServerDisconnectedError:
                continue
            except aiohttp.ClientOSError as exc:
                if "write request body" not in str(exc):
                    raise
        return await self.session.post(self.url, json=body, headers=headers)

    async def send(self, index: int, req: BenchRequest, t0: float) -> RequestResult:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": req.prompt,
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if req.priority is not None:
            body["priority"] = req.priority
        body.update(self.extra_body)
        headers = dict(self.headers)
        if req.tier:
            headers["X-Priority"] = req.tier
        start = time.perf_counter()
        result = RequestResult(index, start - t0, ok=False, tier=req.tier, app=req.app)
        chunk_times: list[float] = []
        usage: dict[str, Any] | None = None
        try:
            async with await self._post(body, headers) as response:
                if response.status != 200:
                    text = (await response.read()).decode(errors="replace")
                    result.error = f"HTTP {response.status}: {_error_message(text)}"
                    return result
                async for raw in response.content:  # one SSE line at a time
                    if not raw.startswith(b"data:"):
                        continue
                    data = raw[5:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.error = _error_message(data.decode(errors="replace"))
                        return result
                    if event.get("usage"):
                        usage = event["usage"]
                    # A chunk with a choice carries a token even when its text is empty (a
                    # byte of an unfinished character), so it counts for TTFT and ITL.
                    if event.get("choices"):
                        chunk_times.append(time.perf_counter())
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, OSError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        end = time.perf_counter()
        result.ok = True
        result.e2e = end - start
        if chunk_times:
            result.ttft = chunk_times[0] - start
            result.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
        # Without a usage chunk (llama-cpp-python), one streamed chunk is taken as one token.
        result.output_tokens = int(usage["completion_tokens"]) if usage else len(chunk_times)
        result.prompt_tokens = int(usage["prompt_tokens"]) if usage else req.prompt_len or 0
        return result


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        return err.get("message", text) if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, AttributeError):
        return text[:200]


SendFn = Callable[[int, BenchRequest, float], Any]


async def run_load(
    send: SendFn,
    requests: list[BenchRequest],
    load: Load,
    seed: int = 0,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request under `load`; results in request order and the run's wall time."""
    times = load.send_times(requests, seed)
    t0 = time.perf_counter()
    results: list[RequestResult | None] = [None] * len(requests)

    async def one(i: int) -> None:
        result = await send(i, requests[i], t0)
        results[i] = result
        if on_done is not None:
            on_done(result)

    if times is None:
        queue = iter(range(len(requests)))

        async def worker() -> None:
            for i in queue:  # a shared iterator: each worker takes the next request
                await one(i)

        await asyncio.gather(*(worker() for _ in range(int(load.value))))
    else:

        async def at(i: int, when: float) -> None:
            delay = t0 + when - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await one(i)

        await asyncio.gather(*(at(i, when) for i, when in enumerate(times)))
    duration = time.perf_counter() - t0
    return [r for r in results if r is not None], duration
