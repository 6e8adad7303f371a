"""What the chat page and other clients read besides the OpenAI routes: `timings` in
llama.cpp's shape, /info, /stats, /requests, opt-in CORS, the page's files and --no-ui,
against a real `dolmus serve` of the built-in model."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import RemoteServer

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
KEY = "k-ui"
AUTH = {"Authorization": f"Bearer {KEY}"}
LLAMA_CPP_TIMINGS = {
    "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
    "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
}  # fmt: skip
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server():
    with RemoteServer(
        "--chat-template", TEMPLATE, "--api-key", KEY, "--gpu-hour-cost", "2.5",
        "--allowed-origins", "http://app.example:3000",
    ) as s:  # fmt: skip
        yield s


def _chat(server: RemoteServer, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 12, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def _events(server: RemoteServer, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _check_timings(t: dict, prompt_tokens: int, completion_tokens: int) -> None:
    assert LLAMA_CPP_TIMINGS <= set(t)
    assert t["prompt_n"] + t["cache_n"] == prompt_tokens
    assert t["predicted_n"] == completion_tokens
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    assert t["ttft_ms"] >= t["queue_ms"] >= 0 and t["preemptions"] == 0
    assert t["cost"] > 0  # --gpu-hour-cost is set


def test_non_stream_bodies_carry_timings(server: RemoteServer) -> None:
    body = _chat(server).json()
    _check_timings(body["timings"], body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Once upon a time", "max_tokens": 7, "n": 2, "temperature": 1.0},
        headers=AUTH,
        timeout=60,
    ).json()
    assert r["timings"]["predicted_n"] == r["usage"]["completion_tokens"] == 14


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_has_timings_once_in_each_final_chunk_and_never_null(
    server: RemoteServer, include_usage: bool
) -> None:
    body = {
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 10,
        "n": 2,
        "stream": True,
        **({"stream_options": {"include_usage": True}} if include_usage else {}),
    }
    events = _events(server, "/v1/chat/completions", body)
    with_timings = [e for e in events if "timings" in e]
    assert all(isinstance(e["timings"], dict) for e in with_timings)  # never null
    if include_usage:
        # one timings, with the usage in the last chunk (clients sum usage over chunks)
        assert with_timings == [events[-1]] and events[-1]["choices"] == []
        assert events[-1]["usage"]["completion_tokens"] == 20
        assert events[-1]["timings"]["predicted_n"] == 20
    else:  # in each choice's final chunk
        assert sorted(e["choices"][0]["index"] for e in with_timings) == [0, 1]
        for e in with_timings:
            assert e["choices"][0]["finish_reason"] is not None and e["timings"]["predicted_n"] == 10
    completion_events = _events(
        server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "stream": True}
    )
    finals = [e for e in completion_events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["timings"]["predicted_n"] == 5


def test_info_needs_no_key_and_tells_what_a_client_needs(server: RemoteServer) -> None:
    info = httpx.get(server.url + "/info").json()
    assert info["model"] == "stories260k" and info["api_key_required"] is True
    assert info["chat_template"] is True
    assert (
        info["max_model_len"]
        == httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["max_model_len"]
    )
    assert info["sampling_defaults"]["temperature"] == 1.0
    assert info["kv_capacity_tokens"] > 0 and info["gpu_hour_cost"] == 2.5
    assert info["engine"]["max_num_seqs"] == 128
    # the host CPU's profile: the level our kernels run at (DOLMUS_CPU_ISA may cap it)
    assert info["cpu"]["isa"] in ("none", "avx2", "avx512", "amx") and info["cpu"]["cores"] >= 1


def test_stats_totals_match_metrics_and_samples_accumulate(server: RemoteServer) -> None:
    _chat(server)
    first = httpx.get(server.url + "/stats").json()
    assert first["samples"] and all(first["samples"][i]["t"] < first["samples"][i + 1]["t"]
                                    for i in range(len(first["samples"]) - 1))  # fmt: skip
    last = first["samples"][-1]["t"]
    time.sleep(1.5)
    newer = httpx.get(server.url + "/stats", params={"since": last}).json()["samples"]
    assert newer and all(p["t"] > last for p in newer)
    totals = httpx.get(server.url + "/stats").json()["totals"]
    metrics = server.metrics()
    assert totals["generation_tokens"] == metrics["dolmus:generation_tokens_total"]
    assert totals["prompt_tokens"] == metrics["dolmus:prompt_tokens_total"]
    assert totals["finished"]["length"] == metrics['dolmus:request_success_total{finished_reason="length"}']
    assert totals["cost_per_million_generation_tokens"] == pytest.approx(
        metrics["dolmus:cost_per_million_generation_tokens"]
    )
    assert any(p["ttft_p50"] is not None for p in newer)  # a request finished within the minute


def test_requests_list_is_behind_the_key_and_shows_a_running_request(server: RemoteServer) -> None:
    assert httpx.get(server.url + "/requests").status_code == 401
    assert httpx.get(server.url + "/requests", headers=AUTH).json()["data"] == []
    seen: list[dict] = []
    done = threading.Event()

    def long_request() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen.append(json.loads(line[6:]))
        done.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        rows: list[dict] = []
        while not rows and not done.is_set():
            rows = httpx.get(server.url + "/requests", headers=AUTH).json()["data"]
        assert rows, "the request finished before the list showed it"
        row = rows[0]
        assert row["request_id"].startswith("cmpl-")
        assert row["state"] in ("running", "waiting") and row["tier"] == "interactive"
        assert row["prompt_tokens"] > 0 and row["age_s"] >= 0 and row["app"] == "default"
        assert "prompt" not in row and "text" not in row  # ids and counts, never the text
    finally:
        worker.join()


def test_cors_is_opt_in_and_preflights_skip_the_key(server: RemoteServer) -> None:
    preflight = {
        "Origin": "http://app.example:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example:3000"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "http://app.example:3000", **AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example:3000"
    # a request from the page's origin still needs the key; another origin gets no grant
    origin = {"Origin": "http://app.example:3000"}
    assert httpx.get(server.url + "/v1/models", headers=origin).status_code == 401
    evil = {**preflight, "Origin": "http://evil.test"}
    other = httpx.options(server.url + "/v1/chat/completions", headers=evil)
    assert "access-control-allow-origin" not in other.headers


def test_page_files_are_open_and_contained(server: RemoteServer) -> None:
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-security-policy"].startswith("default-src 'self'")
    assert httpx.get(server.url + "/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(server.url + "/ui/%2e%2e/app.py").status_code == 404
    assert httpx.get(server.url + "/ui/vendor").status_code == 404  # a folder, not a file


def test_no_ui_and_no_cors_by_default() -> None:
    with RemoteServer("--no-ui") as s:
        assert httpx.get(s.url + "/").status_code == 404
        assert httpx.get(s.url + "/ui/app.js").status_code == 404
        r = httpx.options(
            s.url + "/v1/models",
            headers={"Origin": "http://app.example:3000", "Access-Control-Request-Method": "GET"},
        )
        assert "access-control-allow-origin" not in r.headers


def test_vendored_files_match_their_manifest() -> None:
    spec = importlib.util.spec_from_file_location("vendor_ui", REPO / "scripts" / "vendor_ui.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.check(REPO / "dolmus" / "server" / "ui" / "vendor") == []
