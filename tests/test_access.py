"""API keys from a tiers file: each key's tier caps its priority; quotas answer 429 with
Retry-After; a request bigger than a minute's quota gets 400; keys are checked on every
model route; a broken tiers file stops `dolmus serve` before a model loads."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import httpx
import openai
import pytest
import yaml
from server_helpers import RemoteServer

from dolmus.server.access import AccessPolicy, QuotaExceeded, TokenBucket, charge


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_spends_a_minute_at_once_and_refills_evenly() -> None:
    clock = Clock()
    bucket = TokenBucket(60, clock)  # one per second
    assert bucket.wait_for(60) == 0
    bucket.take(60)
    assert bucket.wait_for(1) == pytest.approx(1.0)
    clock.now += 10
    assert bucket.wait_for(10) == 0 and bucket.wait_for(15) == pytest.approx(5.0)
    bucket.give_back(1000)  # never above a minute's worth
    assert bucket.level == 60


def test_policy_caps_priority_at_the_keys_tier_and_charges_quotas() -> None:
    policy = AccessPolicy.from_dict(
        {
            "tiers": {"realtime": {"priority": 0}, "bulk": {"priority": 3}},
            "keys": [
                {"key": "rt", "tier": "realtime", "requests_per_minute": 2},
                {"key": "bk", "tier": "bulk", "tokens_per_minute": 100, "app": "nightly"},
            ],
        }
    )
    assert policy.needs_key
    rt, bk = policy.identify("Bearer rt"), policy.identify("bearer  bk ")
    assert (rt.tier, bk.tier, bk.name) == ("realtime", "bulk", "nightly")
    assert policy.identify("Bearer nope") is None and policy.identify(None) is None
    assert policy.priority_for(rt, None) == 0 and policy.priority_for(rt, "bulk") == 3
    assert policy.priority_for(bk, "realtime") == 3 and policy.priority_for(bk, -5) == 3
    with pytest.raises(ValueError, match="X-Priority must be one of realtime, bulk"):
        policy.priority_for(rt, "urgent")
    charge(rt, 10)
    charge(rt, 10)
    with pytest.raises(QuotaExceeded, match="2 requests per minute") as over:
        charge(rt, 10)
    assert 25 < over.value.retry_after <= 30 and over.value.retry_after_header in ("29", "30")
    with pytest.raises(QuotaExceeded, match="more than the key's quota of 100") as huge:
        charge(bk, 101)
    assert huge.value.retry_after is None


def test_tiers_carry_targets_and_count_unnamed_priorities_in_the_nearest_tier() -> None:
    policy = AccessPolicy.from_dict(
        {"tiers": {"rt": {"priority": 0, "ttft_target": 0.5, "tpot_target": 0.05}, "bulk": {"priority": 4}}}
    )
    rt, bulk = policy.tiers["rt"], policy.tiers["bulk"]
    assert rt.met(0.4, 0.04) and not rt.met(0.6, 0.04) and not rt.met(0.4, 0.06) and not rt.met(None, None)
    assert bulk.met(100.0, 10.0)  # no targets: every finished request counts as met
    assert [policy.tier_of(p).name for p in (-3, 0, 2, 4, 9)] == ["rt", "rt", "rt", "bulk", "bulk"]


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"keys": [{"key": "a", "tier": "gold"}]}, "tier must be one of interactive, batch"),
        ({"keys": [{"key": "a", "tier": "batch"}, {"key": "a", "tier": "batch"}]}, "repeats a key"),
        ({"keys": [{"tier": "batch"}]}, "exactly one of key and key_env"),
        ({"keys": [{"key": "a", "tier": "batch", "tokens_per_minute": 0}]}, "positive number"),
        ({"keys": [{"key": "a", "tier": "batch", "rpm": 3}]}, "unknown fields: rpm"),
        ({"tiers": {"x": {"priority": "high"}}}, "integer priority"),
        ({"tiers": {"x": {"priority": 0, "ttft_target": -1}}}, "positive number of seconds"),
        ({"tiers": {"x": {"priority": 0, "slo": 1}}}, "unknown fields: slo"),
        ({"limits": {}}, "mapping with `tiers` and `keys`"),
    ],
)
def test_broken_tiers_files_are_refused_with_the_reason(raw, message) -> None:
    with pytest.raises(ValueError, match=message):
        AccessPolicy.from_dict(raw)


def test_serve_refuses_a_broken_tiers_file_before_loading(tmp_path) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text(yaml.safe_dump({"keys": [{"key": "a", "tier": "gold"}]}))
    proc = subprocess.run(
        [sys.executable, "-m", "dolmus.cli", "serve", "--tiers", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "tier must be one of" in proc.stderr


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_keys_tiers_and_quotas_through_the_server(tmp_path, engine_core) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                # interactive's targets are always met here; batch's TTFT target never is.
                "tiers": {
                    "interactive": {"priority": 0, "ttft_target": 600, "tpot_target": 600},
                    "batch": {"priority": 1, "ttft_target": 1e-9},
                },
                "keys": [
                    {"key": "sk-live", "tier": "interactive", "requests_per_minute": 2},
                    {"key_env": "NIGHTLY_KEY", "tier": "batch", "tokens_per_minute": 400},
                ],
            }
        )
    )
    with RemoteServer(
        "--tiers", str(path), "--engine-core", engine_core, env={"NIGHTLY_KEY": "sk-night"}
    ) as server:
        live = openai.OpenAI(base_url=server.base_url, api_key="sk-live", max_retries=0)
        night = openai.OpenAI(base_url=server.base_url, api_key="sk-night", max_retries=0)
        nobody = openai.OpenAI(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            nobody.models.list()
        assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
        r = httpx.get(f"{server.url}/api/tags", headers={"Authorization": "Bearer sk-wrong"})
        assert r.status_code == 401 and "API key" in r.json()["error"]  # Ollama's error shape under /api/

        # Two requests a minute for the live key, then 429 with a Retry-After in seconds.
        for _ in range(2):
            live.completions.create(model="stories260k", prompt="Once", max_tokens=4)
        with pytest.raises(openai.RateLimitError) as over:
            live.completions.create(model="stories260k", prompt="Once", max_tokens=4)
        retry_after = int(over.value.response.headers["retry-after"])
        assert 1 <= retry_after <= 30 and "2 requests per minute" in over.value.message

        # 400 tokens a minute for the nightly key: prompt + max_tokens are charged and what is
        # not generated comes back, so a short answer leaves room for the next request.
        for _ in range(3):
            out = night.completions.create(model="stories260k", prompt="Once", max_tokens=300, stop=["."])
            assert out.usage.total_tokens < 300
        with pytest.raises(openai.BadRequestError, match="more than the key's quota of 400"):
            night.completions.create(model="stories260k", prompt="Once", max_tokens=450)

        # The batch key may not claim the interactive tier: its request still runs (as batch).
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "stories260k", "prompt": "Once", "max_tokens": 4, "priority": -3},
            headers={"Authorization": "Bearer sk-night", "X-Priority": "interactive"},
        )
        assert r.status_code == 200

        # Per-tier metrics: only requests that reached the engine, each under its tier.
        m = server.metrics()
        assert m['dolmus:tier_requests_total{tier="interactive"}'] == 2
        assert m['dolmus:tier_slo_met_total{tier="interactive"}'] == 2
        assert m['dolmus:tier_requests_total{tier="batch"}'] == 4
        assert m.get('dolmus:tier_slo_met_total{tier="batch"}', 0) == 0
        assert m['dolmus:tier_time_to_first_token_seconds_count{tier="batch"}'] == 4
        # Per app (the keys' names; unnamed keys are key0, key1, ...): requests and tokens.
        assert m['dolmus:app_requests_total{app="key0"}'] == 2 and m['dolmus:app_requests_total{app="key1"}'] == 4
        assert 0 < m['dolmus:app_generation_tokens_total{app="key0"}'] <= 8
        assert m['dolmus:app_prompt_tokens_total{app="key1"}'] >= 4


def test_tiers_file_scheduling_fields_reach_the_engine() -> None:
    policy = AccessPolicy.from_dict(
        {
            "tiers": {
                "rt": {"priority": 0, "ttft_target": 0.5, "reserved_seats": 0.25, "admission": "refuse"},
                "bulk": {"priority": 3, "max_queue_wait": 30},
            }
        }
    )
    rt, bulk = sorted(policy.engine_tiers(), key=lambda t: t.priority)
    assert (rt.reserved_seats, rt.ttft_target, rt.admission) == (0.25, 0.5, "refuse")
    assert (bulk.priority, bulk.max_queue_wait, bulk.admission) == (3, 30.0, "serve")
    assert AccessPolicy.from_dict({"tiers": {"a": 0, "b": 1}}).engine_tiers() == ()  # nothing to enforce
    for raw, message in [
        ({"a": {"priority": 0, "reserved_kv": 1.5}}, "share in"),
        ({"a": {"priority": 0, "admission": "refuse"}}, "needs a ttft_target"),
        ({"a": {"priority": 0, "reserved_tokens": 0.7}, "b": {"priority": 1, "reserved_tokens": 0.4}}, "add up"),
        ({"a": {"priority": 0, "max_queue_wait": 0}}, "positive number of seconds"),
    ]:
        with pytest.raises(ValueError, match=message):
            AccessPolicy.from_dict({"tiers": raw})


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_tier_rules_refuse_with_429_through_the_server(tmp_path, engine_core) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tiers": {
                    # A target no request can meet: once a step is timed, every request is refused.
                    "interactive": {"priority": 0, "ttft_target": 1e-6, "admission": "refuse"},
                    "batch": {"priority": 1, "max_queue_wait": 0.05},
                    "bulk": {"priority": 2},
                }
            }
        )
    )
    with RemoteServer("--tiers", str(path), "--engine-core", engine_core, "--max-num-seqs", "1") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)

        def ask(tier: str, max_tokens: int = 4, **kw):
            return client.completions.create(
                model="stories260k", prompt="Once", max_tokens=max_tokens,
                extra_headers={"X-Priority": tier}, **kw,
            )

        ask("bulk")  # times a step: the estimate has data from now on
        with pytest.raises(openai.RateLimitError, match="time-to-first-token target") as refused:
            ask("interactive")
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.code == "slo_unattainable"

        # The only seat is held by a long batch request, which its equal may not preempt: a
        # second batch request waits past batch's max_queue_wait and is refused.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(ask, "batch", 400, extra_body={"ignore_eos": True})
            while server.metrics().get("dolmus:num_requests_running", 0) < 1:
                pass
            with pytest.raises(openai.RateLimitError, match="max_queue_wait") as late:
                ask("batch")
            assert late.value.code == "queue_timeout"
            assert long.result().usage.completion_tokens == 400  # the running one is untouched
        m = server.metrics()
        assert m["dolmus:admission_refused_total"] == 1 and m["dolmus:queue_timeouts_total"] == 1
        ask("bulk")  # the engine is fine afterwards
