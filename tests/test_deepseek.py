"""DeepSeek-V2 and V3 (multi-head latent attention over a paged latent cache, DeepSeek MoE
routing): greedy tokens and prompt logprobs equal transformers' on tiny random models, with
chunked prefill, prefix hits and preemption crossed.

V2: plain q_proj (q_lora_rank None), softmax group-limited routing with a scaling factor, YaRN
rope (its mscale in the softmax scale). V3: compressed queries, sigmoid routing with a random
non-zero score-correction bias (it picks the experts), renormalized weights; interleaved rope,
and a second V3 with plain (rotate-half) rope."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from dolmus import LLM
from tests.conftest import TOKENIZER_FILES
from tests.helpers import greedy, hf_greedy, hf_logprobs, random_prompts, run_tokens

LENGTHS = (1, 5, 17, 40)
# one latent of 32 + a rotary key of 8, float32, 3 layers
LATENT_BYTES_PER_TOKEN = 3 * (32 + 8) * 4
# per-head K (16 + 8) and V (16) of 4 heads, float32: what the same layers would cache as MHA
MHA_BYTES_PER_TOKEN = 3 * 4 * (16 + 8 + 16) * 4


def _config(kind: str):
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "v2":
        yarn = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        }
        return DeepseekV2Config(
            **common, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
            rope_parameters=yarn, num_experts_per_tok=3,  # more than the kept groups: they matter
        )  # fmt: skip
    return DeepseekV3Config(
        **common, q_lora_rank=48, routed_scaling_factor=2.5, norm_topk_prob=True, num_experts_per_tok=2,
        rope_interleave=kind == "v3",
    )  # fmt: skip


def build_deepseek_dir(kind: str, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from dolmus.config import DEFAULT_MODEL_DIR

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero after init: make it matter
                buffer.copy_(torch.rand_like(buffer) * 0.5)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=["v2", "v3", "v3_rotate_half"])
def deepseek_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deepseek_dir(request.param, tmp_path_factory.mktemp(request.param))


def test_greedy_tokens_and_logprobs_equal_transformers(
    deepseek_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = random_prompts(LENGTHS, seed=3)
    with caplog.at_level(logging.INFO, logger="dolmus.runtime.kv_sizing"):
        llm = LLM(str(deepseek_dir), dtype="float32")
    assert run_tokens(llm, prompts, greedy(16)) == [hf_greedy(deepseek_dir, p, 16) for p in prompts]
    ids = prompts[-1]
    ours, theirs = llm.engine.prompt_logprobs(ids), hf_logprobs(deepseek_dir, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # the cache holds the latent, not per-head K/V, and the start-up log says both sizes
    assert f"{LATENT_BYTES_PER_TOKEN} over 3 layers" in caplog.text
    assert f"{MHA_BYTES_PER_TOKEN} in all" in caplog.text
    assert f"{LATENT_BYTES_PER_TOKEN} bytes per token)" in caplog.text


def test_chunked_prefill_prefix_hits_and_preemption_keep_the_tokens(deepseek_dir: Path) -> None:
    head = random_prompts((48,), seed=4)[0]
    prompts = random_prompts((20, 33, 7, 60), seed=5, prefix=head)
    roomy = run_tokens(LLM(str(deepseek_dir), dtype="float32"), prompts, greedy(24))
    # 12 blocks of 16 tokens of the latent cache
    budget = LATENT_BYTES_PER_TOKEN * 16 * 12
    tight = LLM(str(deepseek_dir), dtype="float32", max_num_batched_tokens=32, kv_cache_memory=budget)
    assert run_tokens(tight, prompts, greedy(24)) == roomy
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_refuses_tensor_parallelism_and_quantized_kv() -> None:
    from dolmus.config import ModelConfig
    from dolmus.distributed.parallel_config import ParallelConfig
    from dolmus.runtime.attention import get_backend
    from dolmus.runtime.attention.kv_store import kv_bytes_per_token
    from dolmus.runtime.layers.unquantized import UnquantizedLinearMethod
    from dolmus.runtime.models.deepseek import DeepseekForCausalLM

    cfg = ModelConfig.from_dict({**_config("v3").to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM.*tensor parallelism"):
        DeepseekForCausalLM(
            cfg,
            torch.float32,
            UnquantizedLinearMethod(),
            get_backend("torch"),
            64,
            ParallelConfig(tp_rank=0, tp_size=2),
        )
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'.*latent"):
        kv_bytes_per_token("int8", 1, 40, torch.float32, latent=True)


def test_the_offload_tier_carries_the_latent_cache(tmp_path: Path) -> None:
    """Preempted requests come back from the host tier (one latent pool per layer, no values
    stored apart) with the tokens of a roomy pool."""
    folder = build_deepseek_dir("v3", tmp_path / "v3")
    prompts = random_prompts((40, 40, 40, 40), seed=2)
    roomy = run_tokens(LLM(str(folder), dtype="float32"), prompts, greedy(48))
    tiered = LLM(
        str(folder),
        dtype="float32",
        kv_cache_memory=LATENT_BYTES_PER_TOKEN * 16 * 16,
        kv_offload="cpu",
        kv_offload_size=0.01,
        max_num_seqs=4,
    )
    assert run_tokens(tiered, prompts, greedy(48)) == roomy
    stats = tiered.engine.stats()
    assert stats.num_preemptions > 0 and stats.preemption_recomputed_tokens == 0
    assert stats.kv_offload_loaded_tokens > 0


def _add_mtp_layer(folder: Path, successor: dict[int, int]) -> None:
    """Write a DeepSeek-V3 MTP layer (model.layers.3.*) into the checkpoint, as the hub's V3
    files carry it: a random MoE decoder layer whose output is damped, eh_proj passing the next
    token's normed embedding through, and a shared head that maps each token's embedding to
    the target's greedy successor of that token (`successor`): drafts that are right exactly
    when the drafter feeds the layer the right token at the right position."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    cfg = _config("v3")
    cfg.num_hidden_layers = 4
    torch.manual_seed(1)
    donor = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    donor.save_pretrained(folder / "donor")
    layer = {k: v for k, v in load_file(folder / "donor" / "model.safetensors").items() if ".layers.3." in k}
    shutil.rmtree(folder / "donor")
    for name in layer:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            layer[name] = layer[name] * 0.1
    weights = load_file(folder / "model.safetensors")
    hidden = cfg.hidden_size
    embed = weights["model.embed_tokens.weight"]
    unit = embed / embed.norm(dim=-1, keepdim=True)
    head = torch.zeros(cfg.vocab_size, hidden)
    for token, after in successor.items():
        head[after] += 20 * unit[token]
    layer.update(
        {
            "model.layers.3.enorm.weight": torch.ones(hidden),
            "model.layers.3.hnorm.weight": torch.ones(hidden),
            "model.layers.3.eh_proj.weight": torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), 1),
            "model.layers.3.shared_head.norm.weight": torch.ones(hidden),
            "model.layers.3.shared_head.head.weight": head,
        }
    )
    save_file({**weights, **layer}, folder / "model.safetensors", metadata={"format": "pt"})


def test_mtp_drafts_keep_the_output_and_are_accepted(tmp_path: Path) -> None:
    """Speculative decoding with the MTP layer gives the plain greedy tokens, with chunked
    prefill, prefix hits and preemption crossed, and its drafts are accepted."""
    folder = build_deepseek_dir("v3", tmp_path / "v3")
    head = random_prompts((20,), seed=7)[0]
    prompts = random_prompts((5, 17, 40, 9), seed=6, prefix=head)
    plain = run_tokens(LLM(str(folder), dtype="float32"), prompts, greedy(40))
    successor = {}
    for prompt, out in zip(prompts, plain):
        run = prompt[-1:] + out
        successor.update(zip(run, run[1:]))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    with pytest.raises(ValueError, match="has no MTP layer"):
        LLM(str(folder), dtype="float32", speculative_config=spec)
    _add_mtp_layer(folder, successor)
    # the MTP layer's latent pool shares the target's blocks: 4 latent layers, 12 blocks
    budget = LATENT_BYTES_PER_TOKEN * 4 // 3 * 16 * 12
    llm = LLM(
        str(folder),
        dtype="float32",
        speculative_config=spec,
        max_num_batched_tokens=16,
        kv_cache_memory=budget,
    )
    assert run_tokens(llm, prompts, greedy(40)) == plain
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens > stats.spec_num_draft_tokens // 4


def test_a_deepseek_draft_model_keeps_its_latent_pools(tmp_path: Path) -> None:
    """A DeepSeek model as the draft model (itself: every draft is right) drafts from latent
    pools of its own in the target's blocks."""
    folder = build_deepseek_dir("v2", tmp_path / "v2")
    prompts = random_prompts((5, 30), seed=8)
    plain = run_tokens(LLM(str(folder), dtype="float32"), prompts, greedy(24))
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(folder), dtype="float32", speculative_config=spec)
    assert run_tokens(llm, prompts, greedy(24)) == plain
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0


# DeepSeek-V2-Lite's config.json as the hub has it (4.x spelling: rope_scaling with "type")
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "first_k_dense_replace": 1,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 102400,
}


def test_a_real_size_config_reads_as_transformers_reads_it() -> None:
    """V2-Lite: YaRN frequencies and attention factor, softmax scale and the cache layout."""
    from transformers import DeepseekV2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from dolmus.config import ModelConfig
    from dolmus.runtime.models.mla import DeepseekRotary, softmax_scale

    cfg = ModelConfig.from_dict(V2_LITE)
    hf = DeepseekV2Config(**{k: v for k, v in V2_LITE.items() if k != "architectures"})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq)
    rotary = DeepseekRotary(cfg, 64, torch.float32)
    torch.testing.assert_close(rotary.cos[:, :32], freqs.cos() * factor, atol=0, rtol=0)
    assert softmax_scale(cfg) == pytest.approx(yarn_apply_mscale(hf.rope_parameters, 192**-0.5), rel=1e-12)
    # 512 + 64 numbers a token and layer, against 16 heads x (128 + 64 + 128) for MHA: 8.9x
    assert cfg.kv_layout() == (1, 576, 512)
    assert (cfg.num_experts, cfg.shared_expert_intermediate_size, cfg.dense_layers) == (64, 2816, [0])
