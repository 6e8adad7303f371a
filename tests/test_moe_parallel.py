"""Mixture-of-Experts over two tensor-parallel ranks: a slice of every expert on each rank
(tensor parallelism) or whole experts on each (expert parallelism) give one rank's greedy tokens,
which are transformers', and its logits; experts that do not split over the ranks are refused by
name. The expert-load counters add up to the tokens each MoE layer ran, times top_k, in the
engine's stats and on a real server's /metrics: every token the model ran, except in the last
layer, which runs a prompt's last row alone (the row it samples from)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import RemoteServer

from dolmus import LLM
from dolmus.engine.metrics import EngineMetrics
from tests.helpers import build_moe_dir, greedy, hf_greedy, random_prompts, run_tokens

LENGTHS = (3, 17, 40)
NEW = 16
TOP_K = 2
# a step budget below the longest prompt: prefill goes in chunks on every layout
ENGINE = dict(dtype="float32", max_num_batched_tokens=32)


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_moe_dir(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def one_rank(moe_dir: Path) -> tuple[LLM, list[list[int]], torch.Tensor]:
    """One rank's engine after generating, its greedy tokens (checked against transformers) and
    the logprobs of the longest prompt (scored after the expert counts were checked)."""
    prompts = random_prompts(LENGTHS, seed=11)
    llm = LLM(str(moe_dir), **ENGINE)
    tokens = run_tokens(llm, prompts, greedy(NEW))
    assert tokens == [hf_greedy(moe_dir, p, NEW) for p in prompts]
    assert _routed_per_layer(llm) == _expected_per_layer(prompts, llm, moe_dir)
    return llm, tokens, llm.engine.prompt_logprobs(prompts[-1])


def _expected_per_layer(prompts: list[list[int]], llm: LLM, folder: Path) -> list[int]:
    """Tokens routed per MoE layer: every token run, times top_k; the last layer ran a prompt's
    last row and the decoded tokens alone (each prompt's NEW sampled rows)."""
    raw = json.loads((folder / "config.json").read_text())
    dense = set(raw.get("mlp_only_layers") or [])
    last = raw["num_hidden_layers"] - 1
    ran = _ran_tokens(prompts, llm)
    layers = [i for i in range(last + 1) if i not in dense]
    return [(len(prompts) * NEW if i == last else ran) * TOP_K for i in layers]


def _routed_per_layer(llm: LLM) -> list[int]:
    return [sum(row) for row in llm.engine.stats().moe_expert_tokens if row]


def _ran_tokens(prompts: list[list[int]], llm: LLM) -> int:
    """Tokens that went through the model: each prompt's uncached ones, and every output but the last."""
    return sum(len(p) for p in prompts) - llm.engine.stats().prefix_cache_hits + len(prompts) * (NEW - 1)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_ranks_give_one_ranks_tokens_and_logits(moe_dir: Path, one_rank, expert_parallel: bool) -> None:
    _, want_tokens, want_logprobs = one_rank
    prompts = random_prompts(LENGTHS, seed=11)
    llm = LLM(str(moe_dir), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        assert run_tokens(llm, prompts, greedy(NEW)) == want_tokens
        # routing is replicated: rank 0 counted every expert's tokens, its own or not
        assert _routed_per_layer(llm) == _expected_per_layer(prompts, llm, moe_dir)
        ours = llm.engine.prompt_logprobs(prompts[-1])
        torch.testing.assert_close(ours, want_logprobs, atol=1e-4, rtol=0)
    finally:
        llm.engine.shutdown()


def _series(text: str, name: str) -> dict[tuple[str, ...], float]:
    """The samples of one MoE metric in Prometheus text: (layer, expert) or (layer,) -> value."""
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            found[tuple(pairs[k] for k in ("layer", "expert") if k in pairs)] = float(value)
    return found


def test_expert_load_reaches_the_stats_and_the_metrics(moe_dir: Path, one_rank) -> None:
    llm = one_rank[0]
    stats = llm.engine.stats()
    rows = stats.moe_expert_tokens
    assert len(rows) == 3 and all(len(row) == 6 for row in rows if row)
    assert [i for i, row in enumerate(rows) if not row] == json.loads(
        (moe_dir / "config.json").read_text()
    ).get("mlp_only_layers", [])
    text = EngineMetrics("m", llm.engine.stats).render().decode()
    routed = _series(text, "dolmus:moe_expert_tokens_total")
    assert routed == {(str(i), str(e)): n for i, row in enumerate(rows) for e, n in enumerate(row)}
    imbalance = _series(text, "dolmus:moe_load_imbalance")
    assert set(imbalance) == {(str(i),) for i, row in enumerate(rows) if row}
    for (layer,), ratio in imbalance.items():
        row = rows[int(layer)]
        assert ratio == pytest.approx(max(row) / (sum(row) / len(row))) and 1 <= ratio <= 6 / TOP_K


@pytest.mark.parametrize("moe_dir", ["qwen2_moe"], indirect=True)
def test_served_with_expert_parallelism_the_metrics_count_every_routed_token(moe_dir: Path) -> None:
    args = ("--model", str(moe_dir), "--dtype", "float32", "--tensor-parallel-size", "2")
    with RemoteServer(*args, "--enable-expert-parallel") as server:
        prompt = random_prompts((21,), seed=12)[0]
        body = {
            "model": str(moe_dir),
            "prompt": prompt,
            "max_tokens": NEW,
            "temperature": 0,
            "ignore_eos": True,
        }
        usage = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["usage"]
        ran = usage["prompt_tokens"] + usage["completion_tokens"] - 1
        samples = server.metrics()
    per_layer: dict[str, float] = {}
    for key, value in samples.items():
        if key.startswith("dolmus:moe_expert_tokens_total{"):
            layer = re.search(r'layer="(\d+)"', key).group(1)  # type: ignore[union-attr]
            per_layer[layer] = per_layer.get(layer, 0) + value
    # layer 1 is dense; the last layer ran the prompt's last row and the decoded tokens alone
    assert per_layer == {"0": ran * TOP_K, "2": usage["completion_tokens"] * TOP_K}


def test_experts_that_do_not_split_over_the_ranks_are_refused(moe_dir: Path, tmp_path: Path) -> None:
    """5 experts over 2 ranks (the model is refused while it is built: only its config matters)."""
    for name in moe_dir.iterdir():
        if name.name != "config.json":
            (tmp_path / name.name).symlink_to(name)
    raw = json.loads((moe_dir / "config.json").read_text())
    raw["num_local_experts" if "num_local_experts" in raw else "num_experts"] = 5
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ValueError, match=r"num_experts \(5\) does not split evenly over tensor_parallel_size 2"
    ):
        LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)


def test_replicas_expert_counts_add_up_layer_by_layer() -> None:
    """Data-parallel replicas' stats merge: the counts of each (layer, expert) are added."""
    from dataclasses import MISSING, fields

    from dolmus.engine.data_parallel import merge_stats
    from dolmus.engine.stats import EngineStats

    required = {
        f.name: 0 for f in fields(EngineStats) if f.default is MISSING and f.default_factory is MISSING
    }
    a = EngineStats(**required, moe_expert_tokens=[[1, 2, 3], [], [4, 0, 0]])
    b = EngineStats(**required, moe_expert_tokens=[[10, 0, 5], [], [0, 0, 6]])
    merged = merge_stats([a, b])
    assert merged.moe_expert_tokens == [[11, 2, 8], [], [4, 0, 6]]
    assert merged.moe_load_imbalance == {0: pytest.approx(11 / 7), 2: pytest.approx(6 / (10 / 3))}


@pytest.mark.parametrize("moe_dir", ["qwen2_moe"], indirect=True)
def test_a_rank_holds_and_reads_only_its_share_of_the_experts(moe_dir: Path) -> None:
    """Built per rank without a process group: under expert parallelism rank r expects and reads
    experts [3r, 3r + 3) whole; under tensor parallelism every expert's r-th half of the inner
    features (gate/up rows, down columns)."""
    from dolmus.config import ModelConfig
    from dolmus.distributed.parallel_config import ParallelConfig
    from dolmus.runtime.layers.unquantized import UnquantizedLinearMethod
    from dolmus.runtime.loader import iter_weights, safetensors_files
    from dolmus.runtime.models.llama import expected_weights
    from dolmus.runtime.models.moe import MoEForCausalLM

    cfg = ModelConfig.from_dir(moe_dir)
    files = safetensors_files(moe_dir)
    state = dict(iter_weights(files))
    gate = state["model.layers.2.mlp.experts.4.gate_proj.weight"]  # [48, 64]
    down = state["model.layers.2.mlp.experts.4.down_proj.weight"]  # [64, 48]
    for rank in range(2):
        model = MoEForCausalLM(
            cfg, torch.float32, UnquantizedLinearMethod(), None, 64, ParallelConfig(rank, 2, True)
        )
        mine = set(range(3 * rank, 3 * rank + 3))
        shards = {s for n, s in expected_weights(model) if n == "model.layers.0.mlp.experts.w13"}
        assert shards == {f"{part}:{e}" for e in mine for part in ("gate", "up")}
        read = [name for name, _ in iter_weights(files, keep=model.keeps_weight)]
        experts_read = {int(re.search(r"experts\.(\d+)\.", n).group(1)) for n in read if ".experts." in n}  # type: ignore[union-attr]
        assert experts_read == mine and len(read) < len(state)
        model.load_weights(iter_weights(files, keep=model.keeps_weight))  # nothing of its own missing
        model.load_weights(state.items())  # other ranks' experts in the stream are skipped, not refused
        experts = model.model.layers[2].mlp.experts
        assert experts.w13.shape == (3, 96, 64)
        if 4 in mine:
            assert torch.equal(experts.w13[4 - 3, :48], gate) and torch.equal(experts.w2[4 - 3], down)

        model = MoEForCausalLM(
            cfg, torch.float32, UnquantizedLinearMethod(), None, 64, ParallelConfig(rank, 2)
        )
        model.load_weights(state.items())
        experts = model.model.layers[2].mlp.experts
        assert experts.w13.shape == (6, 48, 64)
        half = slice(24 * rank, 24 * rank + 24)
        assert torch.equal(experts.w13[4, :24], gate[half]) and torch.equal(experts.w2[4], down[:, half])
