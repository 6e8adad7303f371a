"""Fleet prefix-cache hit rate of dolmus replicas behind sglang-router and vllm-router.

Two `dolmus serve` replicas of the built-in model with small KV pools (cache pressure), each
publishing KV events on loopback; then, for every router policy, one router from PyPI in
front of them and the same multi-turn chat workload through it (dolmus/bench/fleet.py: seven
users over two shared system prompts, each opening with a long text of their own, three
turns, the users' turns sent together in waves). Caches are flushed between policies. Prints
each policy's fleet hit rate (hit prompt tokens / looked-up prompt tokens, summed over the
replicas' /metrics), its ratio to round robin on the same router, and whether its greedy
answers match the first policy's. The same setup as tests/test_routers.py.

    python benchmarks/router_hit_rate.py [--kv-blocks 80] [--max-num-seqs 2] [--rounds 1] [--debug]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dolmus.bench.fleet import (  # noqa: E402
    KVEventSource,
    RouterProcess,
    conversations,
    fleet_hit_rate,
    flush_caches,
    prefix_counters,
    router_binary,
    run_conversations,
)
from dolmus.bench.spawn import ServerProcess, free_port  # noqa: E402

BLOCK_BYTES = 16 * 1280  # a 16-token block of the built-in model in float32
POLICIES = (
    "sglang:round_robin", "sglang:cache_aware", "vllm:round_robin", "vllm:cache_aware", "vllm:kv_aware",
)  # fmt: skip


def start_replica(
    i: int, kv_blocks: int, max_num_seqs: int, logs: Path
) -> tuple[ServerProcess, KVEventSource]:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    events = {"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": replay, "bind": True}
    args = ["--kv-cache-memory", str(kv_blocks * BLOCK_BYTES), "--max-num-seqs", str(max_num_seqs)]
    args += ["--kv-events-config", json.dumps(events)]
    log = logs / f"replica{i}.log"
    server = ServerProcess(*args, env={"HF_HUB_OFFLINE": "1"}, log=log, startup_timeout=120)
    return server, KVEventSource(server.url, pub, replay)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-blocks", type=int, default=80, help="KV pool of each replica, in 16-token blocks")
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every policy, interleaved")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), help="ROUTER:POLICY ...")
    ap.add_argument("--debug", action="store_true", help="routers log every decision (see logs/)")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="dolmus-routers-"))
    with ThreadPoolExecutor(2) as pool:
        pairs = list(pool.map(lambda i: start_replica(i, args.kv_blocks, args.max_num_seqs, logs), range(2)))
    urls = [p[0].url for p in pairs]
    sources = [p[1] for p in pairs]
    first_answers: list[list[str]] | None = None
    try:
        header = ("round", "router:policy", "hit rate", "vs rr", "same answers", "seconds")
        print("{:>5} {:20} {:>9} {:>6} {:>13} {:>8}".format(*header))
        for rnd in range(args.rounds):
            rates: dict[str, float] = {}
            for spec in args.policies:
                kind, policy = spec.split(":")
                if router_binary(kind) is None:
                    print(f"{rnd:5} {spec:20} skipped: {kind}-router is not installed")
                    continue
                flush_caches(urls)
                before = [prefix_counters(u) for u in urls]
                kv = sources if policy == "kv_aware" else ()
                start = time.monotonic()
                log = logs / f"{kind}-{policy}-{rnd}.log"
                router = RouterProcess(kind, urls, policy, kv, model="stories260k", log=log, debug=args.debug)
                with router:
                    answers = run_conversations(router.url, "stories260k", conversations())
                elapsed = time.monotonic() - start
                rates[spec] = rate = fleet_hit_rate(before, [prefix_counters(u) for u in urls])
                first_answers = first_answers or answers
                rr = rates.get(f"{kind}:round_robin")
                ratio = f"{rate / rr:5.2f}x" if rr else "     -"
                same = str(answers == first_answers)
                print(f"{rnd:5} {spec:20} {rate:9.3f} {ratio:>6} {same:>13} {elapsed:8.1f}", flush=True)
    finally:
        for server, _ in pairs:
            server.stop()
    print(f"logs: {logs}", file=sys.stderr)


if __name__ == "__main__":
    main()
