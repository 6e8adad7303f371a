"""The server under many users: concurrency with disconnects, admission control, tiers."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest
from server_helpers import RemoteServer

MODEL = "stories260k"
OPENINGS = ["Once upon a time", "The cat", "Tom had a red ball", "One day, Lily", "The sun was hot", "A bird"]


def _client(server: RemoteServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


async def _wait_for_idle(server: RemoteServer) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds KV blocks (aborts land at the next step)."""
    for _ in range(100):
        m = server.metrics()
        if m["dolmus:kv_cache_blocks_used"] == 0 and m["dolmus:num_requests_running"] == 0:
            return m
        await asyncio.sleep(0.1)
    return server.metrics()


def test_64_streams_with_16_disconnects(tmp_path) -> None:
    rng = random.Random(0)
    jobs = []
    for i in range(64):
        prompt = f"{rng.choice(OPENINGS)} {' '.join(rng.choice(OPENINGS) for _ in range(rng.randint(0, 12)))}"
        jobs.append({"prompt": prompt.strip(), "max_tokens": rng.randint(4, 160), "disconnect": i % 4 == 3})

    with RemoteServer("--max-num-seqs", "32", log=tmp_path / "server.log") as server:

        async def run() -> None:
            async with _client(server) as client:
                await _body(client)

        async def _body(client: openai.AsyncOpenAI) -> None:
            # Each request alone first: the reference for its streamed result under load.
            single = [
                await client.completions.create(
                    model=MODEL, prompt=j["prompt"], max_tokens=j["max_tokens"], temperature=0
                )
                for j in jobs
            ]
            before = server.metrics()

            async def stream(j: dict) -> tuple[str, str | None, int]:
                kwargs = dict(model=MODEL, prompt=j["prompt"], temperature=0, stream=True)
                if j["disconnect"]:  # long enough to still be running when the client leaves
                    kwargs.update(max_tokens=400, extra_body={"ignore_eos": True})
                else:
                    kwargs.update(max_tokens=j["max_tokens"])
                texts, finish, chunks = [], None, 0
                response = await client.completions.create(**kwargs)
                async for chunk in response:
                    chunks += 1
                    texts.append(chunk.choices[0].text)
                    finish = chunk.choices[0].finish_reason or finish
                    if j["disconnect"] and chunks == 5:
                        await response.close()
                        break
                return "".join(texts), finish, chunks

            results = await asyncio.gather(*(stream(j) for j in jobs))
            for j, ref, (text, finish, _) in zip(jobs, single, results):
                if j["disconnect"]:
                    assert finish is None
                    continue
                assert finish == ref.choices[0].finish_reason
                assert text == ref.choices[0].text

            after = await _wait_for_idle(server)
            assert after["dolmus:kv_cache_blocks_used"] == 0
            assert after["dolmus:kv_cache_usage_perc"] == 0
            assert after["dolmus:num_requests_running"] == 0 and after["dolmus:num_requests_waiting"] == 0
            aborted = 'dolmus:request_success_total{finished_reason="abort"}'
            assert after[aborted] - before[aborted] == 16
            # ... and the server still answers.
            again = await client.completions.create(
                model=MODEL, prompt=jobs[0]["prompt"], max_tokens=jobs[0]["max_tokens"], temperature=0
            )
            assert again.choices[0].text == single[0].choices[0].text

        asyncio.run(run())


def test_non_streaming_client_disconnect_aborts(tmp_path) -> None:
    with RemoteServer(log=tmp_path / "server.log") as server:
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "temperature": 0}

        async def run() -> dict[str, float]:
            async with httpx.AsyncClient(timeout=60) as http:
                post = asyncio.create_task(http.post(f"{server.url}/v1/completions", json=body))
                while server.metrics()["dolmus:num_requests_running"] == 0:  # until it is decoding
                    await asyncio.sleep(0.01)
                post.cancel()  # the client goes away mid-generation
                with pytest.raises(asyncio.CancelledError):
                    await post
            return await _wait_for_idle(server)

        m = asyncio.run(run())
        assert m["dolmus:kv_cache_blocks_used"] == 0
        assert m['dolmus:request_success_total{finished_reason="abort"}'] == 1
        assert m['dolmus:request_success_total{finished_reason="length"}'] == 0


def test_flood_beyond_max_waiting_gets_429(tmp_path) -> None:
    with RemoteServer("--max-num-seqs", "2", "--max-waiting", "2", log=tmp_path / "server.log") as server:

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
                return await asyncio.gather(
                    *(http.post(f"{server.url}/v1/completions", json=body) for _ in range(24))
                )

        responses = asyncio.run(run())
        admitted = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 429]
        assert len(admitted) + len(refused) == len(responses)
        assert refused and len(admitted) >= 2
        for r in refused:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        for r in admitted:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 300


def test_interactive_request_overtakes_batch(tmp_path) -> None:
    with RemoteServer("--max-num-seqs", "8", log=tmp_path / "server.log") as server:

        async def run() -> None:
            async with _client(server) as client:
                await _body(client)

        async def _body(client: openai.AsyncOpenAI) -> None:
            started = asyncio.Event()
            finished_at: list[float] = []

            async def batch_request(i: int) -> None:
                response = await client.completions.create(
                    model=MODEL,
                    prompt=OPENINGS[i % len(OPENINGS)],
                    max_tokens=300,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                    extra_headers={"X-Priority": "batch"},
                )
                async for _ in response:
                    started.set()
                finished_at.append(time.monotonic())

            batch = [asyncio.create_task(batch_request(i)) for i in range(32)]
            await started.wait()
            # Every seat taken and the rest queued before the interactive request comes: the
            # first chunk alone can arrive while the server is still taking the batch in.
            while True:
                m = await asyncio.to_thread(server.metrics)
                if m["dolmus:num_requests_running"] == 8 and m["dolmus:num_requests_waiting"] > 0:
                    break
                await asyncio.sleep(0.05)
            sent = time.monotonic()
            response = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=8,
                temperature=0,
                stream=True,
                extra_headers={"X-Priority": "interactive"},
            )
            first_token = None
            async for chunk in response:
                if chunk.choices and chunk.choices[0].delta.content and first_token is None:
                    first_token = time.monotonic()
            await asyncio.gather(*batch)
            assert first_token is not None
            # The interactive request got its first token before any batch request finished
            # (8 seats, 32 batch requests of 300 tokens: without tiers it waits for a seat).
            assert first_token < min(finished_at)
            ttft, batch_e2e = first_token - sent, max(finished_at) - sent
            assert ttft < batch_e2e / 4
            m = server.metrics()
            assert m["dolmus:num_preemptions_total"] >= 1

        asyncio.run(run())


def test_body_priority_field(tmp_path) -> None:
    """`priority` in the body orders requests too (lower first) and wins over the header."""
    with RemoteServer("--max-num-seqs", "1", log=tmp_path / "server.log") as server:

        async def run() -> list[str]:
            order: list[str] = []
            async with httpx.AsyncClient(timeout=120) as http:

                async def post(name: str, priority: int, delay: float) -> None:
                    await asyncio.sleep(delay)
                    body = {
                        "prompt": "Once upon a time",
                        "max_tokens": 480,
                        "ignore_eos": True,
                        "temperature": 0,
                        "priority": priority,
                    }
                    r = await http.post(
                        f"{server.url}/v1/completions", json=body, headers={"X-Priority": "batch"}
                    )
                    assert r.status_code == 200
                    order.append(name)

                await asyncio.gather(post("first", 5, 0), post("low", 5, 0.05), post("high", -1, 0.1))
            return order

        order = asyncio.run(run())
        assert order.index("high") < order.index("low")
