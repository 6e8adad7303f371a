"""Replicas behind a router: start sglang-router or vllm-router from PyPI in front of dolmus
replicas, drive a multi-turn chat workload through it, and read the fleet's prefix-cache hits.

A router's value in front of replicas is where it sends a conversation's next turn: to the
replica that still holds the conversation so far, or elsewhere, where it is prefilled again.
The workload is built to show that difference under cache pressure: several users share a few
system prompts, each opens with a long text of their own, and every user's next turn goes out
in the same wave (so a replica's cache sees the other users' traffic between two turns of the
same user). The hit rate is the fleet's: prompt tokens found in any replica's prefix cache
over prompt tokens looked up, from each replica's /metrics. docs/routers.md has the why of
each choice and the measurements.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from dolmus.bench.spawn import free_port

_BINARIES = {"sglang": "sglang-router", "vllm": "vllm-router"}
_STARTUP_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 5.0  # both routers drain on SIGTERM (sglang's default grace is 180 s)
_REQUEST_TIMEOUT_S = 60.0
# vllm-router subscribes to KV events as it starts and takes the first batch it gets as its
# starting point: what is published before its subscription reaches a replica is lost to it.
# ZMQ joins over loopback in milliseconds; this leaves room for a busy CPU.
_SUBSCRIBE_S = 0.5


def router_binary(kind: str) -> str | None:
    """The router's console script: next to this interpreter (a venv), else on PATH."""
    name = _BINARIES[kind]
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


@dataclass(frozen=True)
class KVEventSource:
    """Where a replica publishes its KV events (vllm-router's kv_aware subscribes to them)."""

    worker_url: str
    endpoint: str  # tcp://127.0.0.1:PORT, bound by the replica
    replay_endpoint: str | None = None


def router_command(
    kind: str,
    binary: str,
    port: int,
    metrics_port: int,
    worker_urls: Sequence[str],
    policy: str,
    kv_sources: Sequence[KVEventSource] = (),
    block_size: int = 16,
    model: str | None = None,
    debug: bool = False,
    decode_urls: Sequence[str] = (),
) -> list[str]:
    """The command line of `kind` (sglang | vllm) routing `worker_urls` by `policy`, on loopback.
    With `decode_urls` (vllm only): prefill/decode disaggregation, `worker_urls` prefilling."""
    if decode_urls:
        if kind != "vllm":
            raise ValueError("prefill/decode disaggregation is driven by vllm-router here")
        workers = ["--vllm-pd-disaggregation"]
        workers += [arg for url in worker_urls for arg in ("--prefill", url)]
        workers += [arg for url in decode_urls for arg in ("--decode", url)]
    else:
        workers = ["--worker-urls", *worker_urls]
    common = ["--host", "127.0.0.1", "--port", str(port), *workers, "--policy", policy]
    common += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    if kind == "sglang":
        level = "debug" if debug else "warn"
        return [binary, "launch", *common, "--log-level", level, "--shutdown-grace-period-secs", "1"]
    cmd = [binary, *common, "--log-level", "debug" if debug else "warning"]
    for source in kv_sources:
        cmd += ["--kv-event-source", f"{source.worker_url}={source.endpoint}"]
        if source.replay_endpoint is not None:
            cmd += ["--kv-event-replay-source", f"{source.worker_url}={source.replay_endpoint}"]
    if kv_sources:
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model or "default"]
    return cmd


class RouterProcess:
    """A router from PyPI on a free loopback port; returns once every worker is routable."""

    def __init__(
        self,
        kind: str,
        worker_urls: Sequence[str],
        policy: str,
        kv_sources: Sequence[KVEventSource] = (),
        block_size: int = 16,
        model: str | None = None,
        log: Path | None = None,
        debug: bool = False,
        decode_urls: Sequence[str] = (),
    ) -> None:
        """`debug`: the router logs every routing decision (to `log`); `decode_urls`: vllm-router
        in prefill/decode mode, `worker_urls` being the prefill workers."""
        binary = router_binary(kind)
        if binary is None:
            raise FileNotFoundError(f"{_BINARIES[kind]} is not installed (pip install 'dolmus[router]')")
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        metrics_port = free_port()
        cmd = router_command(
            kind, binary, self.port, metrics_port, worker_urls, policy, kv_sources, block_size, model, debug,
            decode_urls,
        )  # fmt: skip
        self._log: IO[bytes] | int = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(len(worker_urls))
            if kv_sources:
                time.sleep(_SUBSCRIBE_S)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, num_workers: int) -> None:
        """Ready: /v1/models answers with a model and (sglang, which registers workers in the
        background) every worker is listed; a request routed earlier could only go to some."""
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} router exited with status {self.proc.returncode}")
            try:
                models = httpx.get(f"{self.url}/v1/models", timeout=2)
                if models.status_code == 200 and models.json().get("data"):
                    if self.kind != "sglang":
                        return
                    loads = httpx.get(f"{self.url}/get_loads", timeout=2).json()
                    if len(loads.get("workers", ())) == num_workers:
                        return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.kind} router was not ready within {_STARTUP_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not isinstance(self._log, int):
            self._log.close()

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the workload ---------------------------------------------------------------------------

_WORDS = (
    "the little girl saw a big red ball in the park and she was very happy to play with her "
    "friend the dog who liked to run fast under the blue sky near the old tree by the river "
    "one day a small bird sang a song and the boy smiled because the sun was warm and bright"
).split()


@dataclass
class Conversation:
    """One user's chat: a shared system prompt, then user and assistant messages turn by turn."""

    system: str
    questions: list[str]
    messages: list[dict[str, str]] = field(init=False)

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.system}]


def conversations(
    num_users: int = 7,
    num_systems: int = 2,
    turns: int = 3,
    system_words: int = 8,
    document_words: int = 60,
    question_words: int = 6,
    seed: int = 0,
) -> list[Conversation]:
    """`num_users` conversations over `num_systems` shared system prompts. Each user opens with
    a long text of their own (several KV blocks: stories260k spends about two tokens on a
    word), then asks short questions about it, so a conversation's own history, not the shared
    system prompt, is most of every prompt: what a router keeps or loses by where it routes."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    systems = [f"Story teller {i}: " + text(system_words) for i in range(num_systems)]
    convs = []
    for u in range(num_users):
        opening = f"User {u} writes: " + text(document_words)
        questions = [f"User {u} asks: " + text(question_words) for _ in range(turns - 1)]
        convs.append(Conversation(systems[u % num_systems], [opening, *questions]))
    return convs


def run_conversations(
    base_url: str, model: str, convs: Sequence[Conversation], max_tokens: int = 16, stagger: float = 0.005
) -> list[list[str]]:
    """Play the conversations in waves: every user's next turn at once, sent in user order
    `stagger` seconds apart, the next wave when all are answered. The users are in flight
    together (a router balancing by load has loads to go by), yet they arrive in user order
    under every policy (unless a thread is held up longer than `stagger`), so round robin's
    placement does not drift with timing: with an odd number of users on two replicas, each
    user's next turn lands on the other replica. Returns each user's answers in turn order."""

    def ask(http: httpx.Client, conv: Conversation, question: str) -> str:
        conv.messages.append({"role": "user", "content": question})
        body = {"model": model, "messages": conv.messages, "max_tokens": max_tokens, "temperature": 0}
        response = http.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        answer = response.json()["choices"][0]["message"]["content"] or ""
        conv.messages.append({"role": "assistant", "content": answer})
        return answer

    answers: list[list[str]] = [[] for _ in convs]
    turns = max(len(c.questions) for c in convs)
    limits = httpx.Limits(max_connections=len(convs))
    with (
        httpx.Client(base_url=base_url.rstrip("/"), timeout=_REQUEST_TIMEOUT_S, limits=limits) as http,
        ThreadPoolExecutor(max_workers=len(convs)) as pool,
    ):
        for turn in range(turns):
            futures = {}
            for u, conv in enumerate(convs):
                if turn < len(conv.questions):
                    futures[u] = pool.submit(ask, http, conv, conv.questions[turn])
                    time.sleep(stagger)
            for u, future in futures.items():
                answers[u].append(future.result())
    return answers


def prefix_counters(worker_url: str) -> tuple[float, float]:
    """(hit tokens, queried tokens) of one replica's prefix cache since it started."""
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    hits = queries = 0.0
    for line in text.splitlines():
        if line.startswith("dolmus:prefix_cache_hits_total"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("dolmus:prefix_cache_queries_total"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def fleet_hit_rate(before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]) -> float:
    """Prompt tokens found in any replica's cache over prompt tokens looked up, between two
    readings of every replica's counters."""
    hits = sum(end[0] - start[0] for start, end in zip(before, after))
    queries = sum(end[1] - start[1] for start, end in zip(before, after))
    return hits / queries if queries else 0.0


def flush_caches(worker_urls: Sequence[str]) -> None:
    """Empty every replica's prefix cache (between runs, so no policy inherits another's)."""
    for url in worker_urls:
        httpx.post(f"{url}/flush_cache", timeout=10).raise_for_status()
