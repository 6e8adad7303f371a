"""Soak: 256 concurrent streams of two tiers against a tiny KV pool, with clients leaving
mid-stream and malformed requests mixed in.

Every stream that finishes must equal its request run alone, nothing may answer 5xx, the
server's memory must stay flat from one wave to the next, and the engine must be idle at
the end. CI runs two waves; `DOLMUS_SOAK_SECONDS=300` keeps sending waves for that long
and prints what it saw (the figures in issue notes come from that run).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import openai
import yaml
from server_helpers import RemoteServer

MODEL = "stories260k"
STREAMS = 256
OPENINGS = ["Once upon a time", "The cat", "Tom had a red ball", "One day, Lily", "The sun was hot", "A bird"]
# Bodies a careless or hostile client sends: each must get a 4xx and disturb nobody.
MALFORMED: list[bytes | dict] = [
    b'{"model": "stories260k", "prompt": "Once",',  # cut short
    b'{"model": "stories260k", "prompt": "\\ud800"}',  # a lone surrogate
    {"model": MODEL, "prompt": "Once", "n": 1_000_000},
    {"model": MODEL, "prompt": "Once", "max_tokens": -5},
    {"model": MODEL, "prompt": [[1, 2], "x"]},
    {"model": MODEL, "prompt": "Once", "temperature": "hot"},
    {"model": MODEL, "prompt": "Once", "max_tokens": 10**9},
    {"model": "no-such-model", "prompt": "Once"},
    b'{"model": "stories260k", "prompt": "Once", "stop": ["\\ud800"]}',
    {"model": MODEL, "messages": "hello"},
]


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _jobs(rng: random.Random, n: int) -> list[dict]:
    jobs = []
    for _ in range(n):
        words = " ".join(rng.choice(OPENINGS) for _ in range(rng.randint(0, 8)))
        jobs.append({"prompt": f"{rng.choice(OPENINGS)} {words}".strip(), "max_tokens": rng.randint(4, 96)})
    return jobs


def test_soak_256_streams_tiny_kv_disconnects_and_malformed_requests(tmp_path) -> None:
    soak_seconds = float(os.environ.get("DOLMUS_SOAK_SECONDS", "0"))
    rng = random.Random(0)
    distinct = _jobs(rng, 24)
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(
        yaml.safe_dump(
            {"tiers": {"interactive": {"priority": 0, "reserved_seats": 0.25, "reserved_tokens": 0.25}, "batch": 1}}
        )
    )
    # ~1,500 tokens of KV for 64 seats of up to ~150 tokens each: preemption all the time.
    args = ["--tiers", str(tiers), "--max-num-seqs", "64", "--kv-cache-memory", "2000000"]
    with RemoteServer(*args, log=tmp_path / "server.log") as server:

        async def run() -> dict:
            # Idle connections retire before uvicorn closes them (5 s), so none is reused as it closes.
            limits = httpx.Limits(max_connections=STREAMS + 16, keepalive_expiry=1.0)
            async with httpx.AsyncClient(limits=limits, timeout=300) as http, openai.AsyncOpenAI(
                base_url=server.base_url, api_key="unused", max_retries=0, timeout=300, http_client=http
            ) as client:
                single = [
                    await client.completions.create(
                        model=MODEL, prompt=j["prompt"], max_tokens=j["max_tokens"], temperature=0
                    )
                    for j in distinct
                ]
                reference = [(s.choices[0].text, s.choices[0].finish_reason) for s in single]
                return await _waves(server, client, http, distinct, reference, soak_seconds, rng)

        seen = asyncio.run(run())
        after = seen["idle"]
        assert after["dolmus:kv_cache_blocks_used"] == 0
        assert after["dolmus:num_requests_running"] == 0 and after["dolmus:num_requests_waiting"] == 0
        assert seen["statuses_5xx"] == 0
        assert seen["mismatches"] == []
        assert after["dolmus:num_preemptions_total"] > 0  # the pool really was too small
        # Memory is flat from the first wave on (allocator noise allowed).
        assert seen["rss"][-1] - seen["rss"][0] < 64 * 2**20, seen["rss"]
        if soak_seconds:
            print(json.dumps({k: v for k, v in seen.items() if k != "idle"}, indent=1))


async def _waves(
    server: RemoteServer,
    client: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
    jobs: list[dict],
    reference: list[tuple[str, str]],
    soak_seconds: float,
    rng: random.Random,
) -> dict:
    seen: dict = {"waves": 0, "streams": 0, "finished": 0, "disconnected": 0, "malformed": 0,
                  "statuses_5xx": 0, "mismatches": [], "rss": [], "seconds": 0.0}
    start = time.monotonic()

    async def stream(k: int, leave_after: int | None, tier: str) -> None:
        text, finish, chunks = [], None, 0
        response = await client.completions.create(
            model=MODEL,
            prompt=jobs[k]["prompt"],
            max_tokens=jobs[k]["max_tokens"],
            temperature=0,
            stream=True,
            extra_headers={"X-Priority": tier},
        )
        async for chunk in response:
            chunks += 1
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
            if leave_after is not None and chunks >= leave_after:
                await response.close()
                seen["disconnected"] += 1
                return
        seen["finished"] += 1
        if ("".join(text), finish) != reference[k]:
            seen["mismatches"].append({"job": k, "tier": tier, "got": "".join(text), "want": reference[k][0]})

    async def malformed(body: bytes | dict) -> None:
        if isinstance(body, dict):
            r = await http.post(f"{server.url}/v1/completions", json=body)
        else:
            r = await http.post(
                f"{server.url}/v1/completions", content=body, headers={"Content-Type": "application/json"}
            )
        seen["malformed"] += 1
        if r.status_code >= 500:
            seen["statuses_5xx"] += 1
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)

    while True:
        tasks = []
        for i in range(STREAMS):
            k = rng.randrange(len(reference))
            leave_after = rng.randint(1, 6) if rng.random() < 0.125 else None
            tasks.append(stream(k, leave_after, rng.choice(["interactive", "batch"])))
            if i % 16 == 0:
                tasks.append(malformed(rng.choice(MALFORMED)))
        rng.shuffle(tasks)
        try:
            await asyncio.gather(*tasks)
        except openai.APIStatusError as exc:  # a 5xx in a stream's opening response
            seen["statuses_5xx"] += exc.status_code >= 500
            raise
        seen["waves"] += 1
        seen["streams"] += STREAMS
        seen["rss"].append(_rss_bytes(server.proc.pid))
        if seen["waves"] >= 2 and time.monotonic() - start >= soak_seconds:
            break
    seen["seconds"] = round(time.monotonic() - start, 1)
    for _ in range(100):
        m = server.metrics()
        if m["dolmus:kv_cache_blocks_used"] == 0 and m["dolmus:num_requests_running"] == 0:
            break
        await asyncio.sleep(0.1)
    seen["idle"] = m
    seen["preemptions"] = m["dolmus:num_preemptions_total"]
    return seen
