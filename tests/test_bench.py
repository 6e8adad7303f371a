"""`dolmus bench | replay | tune` against real servers and engines (stories260k)."""

from __future__ import annotations

import json
import os
import random

import pytest
from server_helpers import RemoteServer

from dolmus.bench.dataset import BenchRequest, LengthDist, load_sharegpt
from dolmus.bench.loadgen import Load
from dolmus.bench.stats import meets_slo, parse_slo
from dolmus.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TABLE_HEADER = "| run | ok/err | req/s | out tok/s | TTFT p50/p99 ms"


def _write_trace(path, n: int, rate: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    t = 0.0
    with open(path, "w") as f:
        for i in range(n):
            t += rng.expovariate(rate)
            tier = "interactive" if i % 3 == 0 else "batch"
            row = {
                "timestamp": round(t, 3),
                "prompt_len": rng.randint(8, 64),
                "output_len": rng.randint(4, 32),
                "tier": tier,
                "app": "chat" if tier == "interactive" else "etl",
            }
            f.write(json.dumps(row) + "\n")


def _check_outputs(out_dir) -> dict:
    for name in ("latency_cdf.png", "throughput.png", "ttft_vs_load.png"):
        data = (out_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
    report = (out_dir / "report.md").read_text()
    assert report.startswith("# ") and TABLE_HEADER in report
    assert "![latency_cdf](latency_cdf.png)" in report
    return json.loads((out_dir / "results.json").read_text())


def test_bench_figures_agree_with_the_server(tmp_path, capsys) -> None:
    with RemoteServer("--gpu-hour-cost", "3.0", log=tmp_path / "server.log") as server:
        code = main(
            [
                "bench",
                "--base-url",
                server.base_url,
                "--num-requests",
                "12",
                "--input-len",
                "16:48",
                "--output-len",
                "8:40",
                "--concurrency",
                "1,4",
                "--slo",
                "ttft=1,tpot=0.5",
                "--out",
                str(tmp_path / "out"),
                "--no-progress",
            ]
        )
    assert code == 0
    printed = capsys.readouterr().out
    assert "concurrency 1" in printed and "concurrency 4" in printed
    results = _check_outputs(tmp_path / "out")
    assert [r["label"] for r in results["runs"]] == ["concurrency 1", "concurrency 4"]
    for run in results["runs"]:
        s, server, reqs = run["summary"], run["server"], run["requests"]
        assert s["requests"] == s["completed"] == len(reqs) == 12 and s["errors"] == 0
        # Counts: what the client saw is what the server did.
        assert server["finished_requests"] == 12
        assert s["output_tokens"] == server["generation_tokens"] == sum(r["output_tokens"] for r in reqs)
        assert s["prompt_tokens"] == server["prompt_tokens"]
        assert all(8 <= r["output_tokens"] <= 40 for r in reqs)  # ignore_eos: exactly output-len
        # Latencies: the client's view is the server's plus the network and HTTP handling.
        assert server["mean_ttft"] - 0.005 <= s["ttft"]["mean"] <= server["mean_ttft"] + 0.1
        assert s["tpot"]["mean"] == pytest.approx(server["mean_tpot"], rel=0.5, abs=0.005)
        assert s["itl"]["mean"] == pytest.approx(server["mean_itl"], rel=0.5, abs=0.005)
        assert server["mean_e2e"] - 0.005 <= s["e2e"]["mean"] <= server["mean_e2e"] + 0.1
        assert 0 <= server["prefix_cache_hit_rate"] <= 1
        assert server["cost_per_million_generation_tokens"] > 0  # read from the server's /metrics
        # Goodput agrees with the per-request records.
        slo = parse_slo("ttft=1,tpot=0.5")
        good = sum(
            1 for r in reqs if r["ok"] and r["ttft"] <= slo["ttft"] and (r["tpot"] or 0) <= slo["tpot"]
        )
        assert s["goodput_share"] == pytest.approx(good / 12)
        assert s["goodput"] == pytest.approx(good / s["duration_s"])
        assert s["ttft"]["p50"] <= s["ttft"]["p90"] <= s["ttft"]["p95"] <= s["ttft"]["p99"]


def test_bench_one_command_sharegpt_and_open_loop_arrivals(tmp_path, capsys) -> None:
    sharegpt = tmp_path / "sharegpt.json"
    convs = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me about the {w}."},
                {"from": "gpt", "value": "It was a sunny day. " * (i + 1)},
            ]
        }
        for i, w in enumerate(["cat", "dog", "sun", "tree"])
    ]
    sharegpt.write_text(json.dumps(convs))
    code = main(
        [
            "bench",
            "--serve-args",
            "--max-num-seqs 4",
            "--dataset",
            f"sharegpt:{sharegpt}",
            "--num-requests",
            "6",
            "--rate",
            "20,40",
            "--no-progress",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "rate 20/s" in out and "rate 40/s" in out and "6/0" in out

    out = tmp_path / "burst"
    code = main(
        [
            "bench",
            "--serve-args",
            "--max-num-seqs 4",
            "--num-requests",
            "6",
            "--burst",
            "3:0.2",
            "--output-len",
            "4",
            "--no-progress",
            "--slo",
            "ttft=10",
            "--out",
            str(out),
            "--extra-body",
            '{"max_tokens": 3}',
        ]
    )
    assert code == 0
    requests = json.loads((out / "results.json").read_text())["runs"][0]["requests"]
    assert [r["output_tokens"] for r in requests] == [3] * 6  # --extra-body reached the server
    assert "bursts of 3 every 0.2s" in capsys.readouterr().out


def test_arrival_schedules() -> None:
    reqs = [BenchRequest("x", 1, timestamp=t) for t in (10.0, 10.5, 12.0)]
    assert Load("concurrency", 4).send_times(reqs) is None
    assert Load("trace", 2.0).send_times(reqs) == [0.0, 0.25, 1.0]
    assert Load("burst", 2, interval=5).send_times(reqs) == [0.0, 0.0, 5.0]
    many = [BenchRequest("x", 1)] * 5000
    times = Load("rate", 50).send_times(many, seed=1)
    assert times == Load("rate", 50).send_times(many, seed=1)  # seeded
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert LengthDist.parse("7") == LengthDist(7, 7) and LengthDist.parse("3:9") == LengthDist(3, 9)
    with pytest.raises(ValueError):
        LengthDist.parse("9:3")
    with pytest.raises(ValueError, match="SLO metric"):
        parse_slo("latency=1")


def test_synthetic_shared_prefix() -> None:
    from dolmus.bench.dataset import PromptMaker, synthetic
    from dolmus.config import DEFAULT_MODEL_DIR
    from dolmus.engine.tokenizing import load_tokenizer

    maker = PromptMaker(load_tokenizer(str(DEFAULT_MODEL_DIR)), seed=1)
    reqs = synthetic(
        maker, 200, LengthDist(8, 8), LengthDist(4, 4), seed=2, shared_prefix_len=30, shared_prefix_ratio=0.5
    )
    shared = [r for r in reqs if r.prompt_len == 38]  # 30 shared + 8 own tokens
    assert 70 <= len(shared) <= 130  # about half carry the prefix
    prefix = os.path.commonprefix([r.prompt for r in shared])
    assert len(prefix) >= 30  # one common text: the prefix cache can reuse it
    assert not any(r.prompt.startswith(prefix) for r in reqs if r.prompt_len == 8)
    assert synthetic(maker, 5, LengthDist(8, 8), LengthDist(4, 4), seed=2)[0].prompt_len == 8


def test_sharegpt_loader(tmp_path) -> None:
    path = tmp_path / "s.json"
    path.write_text(
        json.dumps(
            [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "one two three"}]}]
        )
    )
    reqs = load_sharegpt(path, 3)
    assert [r.prompt for r in reqs] == ["Hi"] * 3 and reqs[0].output_len == 4


def test_replay_two_configs_side_by_side_with_tiers(tmp_path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace, 18, rate=1000)  # a burst: all queued within a few steps
    (tmp_path / "tight.yaml").write_text("name: tight\nmax_num_seqs: 2\nmax_num_batched_tokens: 32\n")
    (tmp_path / "roomy.yaml").write_text(
        "name: roomy\nmax_num_seqs: 32\n"
        "tiers:\n  interactive: {priority: 0, reserved_tokens: 0.25}\n  batch: {priority: 1}\n"
    )
    code = main(
        [
            "replay",
            str(trace),
            "--configs",
            str(tmp_path / "tight.yaml"),
            str(tmp_path / "roomy.yaml"),
            "--slo",
            "ttft=0.2",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    table = capsys.readouterr().out.splitlines()
    rows = [
        line.strip().split("  ")[0] for line in table[2:] if line.strip() and not line.startswith("wrote")
    ]
    assert rows == [
        "tight",
        "tight [batch]",
        "tight [interactive]",
        "roomy",
        "roomy [batch]",
        "roomy [interactive]",
    ]
    results = _check_outputs(tmp_path / "out")
    tight, roomy = results["runs"]
    assert tight["config"]["max_num_seqs"] == 2 and roomy["config"]["max_num_seqs"] == 32
    assert roomy["config"]["tier_specs"][0]["reserved_tokens"] == 0.25 and "--tiers FILE" in roomy["flags"]
    assert "tier_specs" not in tight["config"]
    for run in (tight, roomy):
        assert run["summary"]["completed"] == 18
        assert run["tiers"]["batch"]["requests"] + run["tiers"]["interactive"]["requests"] == 18
        assert all(r["queue_time"] is not None for r in run["requests"])
    # Two seats: batch requests wait behind interactive ones. (Compared by the order of first
    # tokens, not by mean TTFTs of a few milliseconds, which flipped under load.)
    order = sorted(tight["requests"], key=lambda r: r["start"] + r["ttft"])
    rank = {tier: [i for i, r in enumerate(order) if r["tier"] == tier] for tier in ("interactive", "batch")}
    assert sum(rank["interactive"]) / 6 < sum(rank["batch"]) / 12 - 3


def test_replay_rejects_unknown_settings(tmp_path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace, 2, rate=10)
    (tmp_path / "bad.yaml").write_text("max_num_sequences: 4\n")
    assert main(["replay", str(trace), "--configs", str(tmp_path / "bad.yaml")]) == 2
    assert "unknown settings" in capsys.readouterr().err


def test_tune_within_budget_beats_or_keeps_default(tmp_path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace, 16, rate=20)
    code = main(
        [
            "tune",
            str(trace),
            "--slo",
            "ttft=0.05,tpot=0.02",
            "--budget-minutes",
            "0.5",
            "--speed",
            "2",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    rec = json.loads((tmp_path / "out" / "recommendation.json").read_text())
    assert rec["elapsed_s"] <= rec["budget_s"] == 30
    runs = {r["label"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["runs"]}
    assert "default" in runs and len(runs) >= 2
    assert runs[rec["best"]]["summary"]["goodput"] >= runs["default"]["summary"]["goodput"]
    assert f"dolmus serve {rec['flags']}" in printed
    for run in runs.values():
        reqs = run["requests"]
        assert run["summary"]["goodput_share"] == pytest.approx(
            sum(meets_slo(_as_result(r), parse_slo("ttft=0.05,tpot=0.02")) for r in reqs) / len(reqs)
        )


def _as_result(r: dict):
    from dolmus.bench.loadgen import RequestResult

    fields = {k: v for k, v in r.items() if k != "tpot"}
    return RequestResult(**fields)


def test_bench_reads_speculative_acceptance_from_the_servers_metrics() -> None:
    from dolmus.bench.report import _server_line
    from dolmus.bench.server_metrics import run_delta

    before = {"spec_decode_num_drafts_total": 10.0, "spec_decode_num_draft_tokens_total": 40.0,
              "spec_decode_num_accepted_tokens_total": 20.0}  # fmt: skip
    after = {"spec_decode_num_drafts_total": 30.0, "spec_decode_num_draft_tokens_total": 120.0,
             "spec_decode_num_accepted_tokens_total": 80.0}  # fmt: skip
    server = run_delta(before, after)
    assert server["spec_acceptance_rate"] == pytest.approx(60 / 80)
    assert server["spec_mean_acceptance_length"] == pytest.approx(1 + 60 / 20)
    assert "draft acceptance 75% (4.00 tokens per drafting step)" in _server_line(server)
    assert "spec_acceptance_rate" not in run_delta({"x": 1.0}, {"x": 2.0})  # a server without drafts


def test_bench_gets_past_keep_alive_connections_the_server_closed(tmp_path, capsys) -> None:
    """A server (as llama-server does) answers each request with a keep-alive response, then
    closes the connection: the next request on the pooled connection cannot be written.
    Every request must still be measured, none lost to the dead connections."""
    import asyncio
    import threading

    chunk = json.dumps({"choices": [{"index": 0, "text": "a"}]})
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 4}})
    body = "".join(f"data: {chunk}\n\n" for _ in range(4)) + f"data: {usage}\n\ndata: [DONE]\n\n"
    served: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        await reader.readexactly(length)
        if not head.startswith(b"POST /v1/completions"):
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        else:
            served.append(1)
            data = body.encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: keep-alive\r\n"
                + f"content-length: {len(data)}\r\n\r\n".encode()
                + data
            )
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # without saying so: the client's pool still holds this connection

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        out = tmp_path / "bench"
        args = ["bench", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "m", "--no-progress"]
        args += [
            "--concurrency",
            "1",
            "--num-requests",
            "6",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--warmup",
            "0",
        ]
        assert main([*args, "--out", str(out)]) == 0
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert [r["error"] for r in run["requests"]] == [None] * 6
    assert all(r["output_tokens"] == 4 for r in run["requests"])
    assert len(served) == 6  # each request reached the server once
