"""Tensor parallelism across two hosts: two network namespaces joined by a veth pair, made
by this test (root only), with the engine and rank 0 on one and `dolmus worker` (rank 1) on
the other, meeting over torch.distributed's env:// rendezvous. Same tokens as one rank; a
lost host ends the engine with a clear error. Traffic stays on the veth pair."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from dolmus import LLM, SamplingParams

HEAD_ADDR, WORKER_ADDR = "10.213.7.1", "10.213.7.2"  # only on this test's veth pair
PROMPTS = ["Once upon a time", "The cat sat on the mat and", "Lily"]
GREEDY = dict(temperature=0, max_tokens=40, ignore_eos=True)

HEAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from dolmus import LLM, SamplingParams
    from dolmus.executor import WorkerDiedError

    def main():
        model, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
        prompts, greedy = json.loads(sys.argv[4]), json.loads(sys.argv[5])
        llm = LLM(model, dtype="float32", tensor_parallel_size=2, nnodes=2, master_addr=addr,
                  master_port=port, distributed_timeout=30)
        outs = llm.generate(prompts, SamplingParams(**greedy))
        print(json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
        sys.stdin.readline()  # the test kills the other host now
        try:
            llm.generate(prompts * 8, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
            print("no error", flush=True)
        except WorkerDiedError as exc:
            print("WorkerDiedError: " + str(exc).splitlines()[0], flush=True)
        llm.engine.shutdown()

    if __name__ == "__main__":
        main()
    """
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Namespaces (head, worker) joined by a veth pair; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    head, worker = f"dolmus-h0-{tag}", f"dolmus-h1-{tag}"
    try:
        _ip("netns", "add", head)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        _ip("netns", "add", worker)
        _ip("link", "add", f"v0-{tag}", "type", "veth", "peer", "name", f"v1-{tag}")
        for ns, link, addr in ((head, f"v0-{tag}", HEAD_ADDR), (worker, f"v1-{tag}", WORKER_ADDR)):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield head, worker
    finally:
        for ns in (head, worker):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_two_hosts_give_one_ranks_tokens_and_a_lost_host_is_an_error(two_hosts, llama_dir, tmp_path) -> None:
    head_ns, worker_ns = two_hosts
    want = [
        o.outputs[0].token_ids
        for o in LLM(str(llama_dir), dtype="float32").generate(PROMPTS, SamplingParams(**GREEDY))
    ]
    script = tmp_path / "head.py"
    script.write_text(HEAD_SCRIPT)
    port = "29517"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    head = subprocess.Popen(
        ["ip", "netns", "exec", head_ns, sys.executable, str(script), str(llama_dir), HEAD_ADDR, port,
         json.dumps(PROMPTS), json.dumps(GREEDY)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "head.log", "wb"), text=True,
        env=env,
    )  # fmt: skip
    worker = subprocess.Popen(
        ["ip", "netns", "exec", worker_ns, sys.executable, "-m", "dolmus.cli", "worker", "--nnodes", "2",
         "--node-rank", "1", "--master-addr", HEAD_ADDR, "--master-port", port, "--wait", "120"],
        stdout=open(tmp_path / "worker.log", "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        line = _read_line(head, 300, tmp_path)
        assert json.loads(line) == want
        head.stdin.write("go\n")
        head.stdin.flush()
        os.killpg(worker.pid, signal.SIGKILL)  # the other host's node process and its rank
        verdict = _read_line(head, 120, tmp_path)
        assert verdict.startswith("WorkerDiedError"), verdict
        head.wait(timeout=60)
    finally:
        for proc in (head, worker):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def _read_line(proc: subprocess.Popen, timeout_s: float, logs: Path) -> str:
    """The process's next stdout line, or a failure with its log, never a hang."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        pytest.fail(f"no answer in {timeout_s} s:\n{(logs / 'head.log').read_text()[-3000:]}\n"
                    f"worker:\n{(logs / 'worker.log').read_text()[-3000:]}")  # fmt: skip
    line = proc.stdout.readline().strip()
    if not line:
        pytest.fail(f"the head exited:\n{(logs / 'head.log').read_text()[-3000:]}\n"
                    f"worker:\n{(logs / 'worker.log').read_text()[-3000:]}")  # fmt: skip
    return line


PREFILL_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from dolmus import LLM, SamplingParams

    def main():
        model, addr, port, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
        llm = LLM(model, dtype="float32",
                  kv_transfer_config={"kv_role": "kv_producer", "kv_ip": addr, "kv_port": port})
        ask = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        outs = llm.generate(prompts, ask)
        print(json.dumps([o.kv_transfer_params for o in outs]), flush=True)
        sys.stdin.readline()  # the outbox stays served until the decode host is done
        llm.engine.shutdown()

    if __name__ == "__main__":
        main()
    """
)

DECODE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from dolmus import LLM, SamplingParams

    def main():
        model, prompts, params, greedy = sys.argv[1], *(json.loads(a) for a in sys.argv[2:5])
        llm = LLM(model, dtype="float32", kv_transfer_config={"kv_role": "kv_consumer"})
        outs = [llm.generate([p], SamplingParams(**greedy, kv_transfer_params=kv))[0]
                for p, kv in zip(prompts, params)]
        print(json.dumps([[o.outputs[0].token_ids, o.num_cached_tokens] for o in outs]), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def test_prefill_on_one_host_decode_on_another(two_hosts, llama_dir, tmp_path) -> None:
    """Disaggregated prefill/decode across hosts: the prefill host advertises its own address
    (kv_ip) in kv_transfer_params, the decode host fetches the prompt's KV from it over the veth
    pair; tokens equal one engine's, every prompt token but the last transferred."""
    head_ns, worker_ns = two_hosts
    engine = LLM(str(llama_dir), dtype="float32")
    want = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, SamplingParams(**GREEDY))]
    lengths = [len(engine.tokenizer.encode(p)) for p in PROMPTS]
    (tmp_path / "prefill.py").write_text(PREFILL_SCRIPT)
    (tmp_path / "decode.py").write_text(DECODE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    prefill = subprocess.Popen(
        ["ip", "netns", "exec", head_ns, sys.executable, str(tmp_path / "prefill.py"), str(llama_dir),
         HEAD_ADDR, "24579", json.dumps(PROMPTS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "head.log", "wb"), text=True,
        env=env,
    )  # fmt: skip
    (tmp_path / "worker.log").write_text("")
    try:
        params = json.loads(_read_line(prefill, 300, tmp_path))
        assert all(p["remote_host"] == HEAD_ADDR for p in params)
        decoded = subprocess.run(
            ["ip", "netns", "exec", worker_ns, sys.executable, str(tmp_path / "decode.py"), str(llama_dir),
             json.dumps(PROMPTS), json.dumps(params), json.dumps(GREEDY)],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert decoded.returncode == 0, decoded.stderr[-3000:]
        results = json.loads(decoded.stdout.strip().splitlines()[-1])
        assert [tokens for tokens, _ in results] == want
        assert [cached for _, cached in results] == [n - 1 for n in lengths]
    finally:
        if prefill.poll() is None:
            prefill.stdin.write("done\n")
            prefill.stdin.flush()
            try:
                prefill.wait(timeout=60)
            except subprocess.TimeoutExpired:
                prefill.kill()
        prefill.wait(timeout=30)
