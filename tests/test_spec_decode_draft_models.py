"""Speculative decoding with a draft model and with EAGLE-3 heads: the output is the
target's, drafts right or wrong, greedy, seeded or sampled."""

from __future__ import annotations

import pytest
from spec_decode_helpers import (
    PROMPTS,
    plain_llm,  # noqa: F401  (the "plain" fixture)
    token_ids,
)

from dolmus import LLM, SamplingParams
from dolmus.config import EngineConfig

# -- a draft model -----------------------------------------------------------------------------


def _draft_spec(**extra) -> dict:
    from dolmus.config import DEFAULT_MODEL_DIR

    return {"method": "draft_model", "model": str(DEFAULT_MODEL_DIR), "num_speculative_tokens": 3, **extra}


def test_the_target_as_its_own_draft_is_always_accepted(plain: LLM):
    """Greedy drafts of the target itself are its own choices: every draft is accepted, and
    the output is the target's."""
    llm = LLM(speculative_config=_draft_spec(adaptive=False))
    params = SamplingParams(max_tokens=60, temperature=0)
    assert token_ids(llm, params) == token_ids(plain, params)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 60 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert llm.engine.runner.drafter is not None


def test_a_quantized_draft_keeps_the_targets_output_across_features(plain: LLM):
    """An int8 copy as the draft (drafts that are sometimes wrong), with chunked prefill of
    seven tokens, a pool small enough to preempt, penalties and min_tokens with n = 2,
    prefix-cache hits and the default adaptive drafting."""
    llm = LLM(
        speculative_config=_draft_spec(quantization="int8"),
        max_num_batched_tokens=7,
        kv_cache_memory=24 * 16 * 2560,  # 24 blocks of 16 tokens, target and draft
        max_num_seqs=8,
    )
    greedy = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    prompts = PROMPTS * 2
    assert token_ids(llm, greedy, prompts) == token_ids(plain, greedy, prompts)
    penalised = SamplingParams(max_tokens=50, temperature=0, repetition_penalty=1.3, min_tokens=30, n=2)
    assert token_ids(llm, penalised) == token_ids(plain, penalised)
    assert token_ids(llm, greedy, PROMPTS[:1]) == token_ids(plain, greedy, PROMPTS[:1])  # cached blocks
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens


def test_draft_model_configs_are_checked():
    from dolmus.config import DEFAULT_MODEL_DIR

    with pytest.raises(ValueError, match="'model'"):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="'model'"):
        EngineConfig(speculative_config={"method": "ngram", "model": str(DEFAULT_MODEL_DIR)})
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(speculative_config=_draft_spec(quantization="int3"))
    with pytest.raises(ValueError, match="'model'"):
        EngineConfig(speculative_config={"method": "eagle3"})


def test_the_target_as_its_own_sampled_draft_is_accepted_and_seeds_give_the_targets_tokens(plain: LLM):
    """Unseeded sampled requests draw their drafts from the draft model's distribution: with
    the target as its own draft p = q, so rejection sampling accepts them (up to rounding).
    Seeded requests get greedy drafts, checked against the target's position-keyed draws:
    the same tokens as without speculation."""
    llm = LLM(speculative_config=_draft_spec(adaptive=False))
    params = SamplingParams(max_tokens=60, temperature=0.9, top_p=0.95, n=2, logprobs=1)
    before = llm.engine.stats()
    outs = llm.generate(PROMPTS, params)
    stats = llm.engine.stats()
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert drafted > 100
    assert stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens >= 0.95 * drafted
    for out in outs:
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids) and all(
                t in lp for t, lp in zip(c.token_ids, c.logprobs)
            )
    seeded = SamplingParams(max_tokens=60, temperature=0.9, top_p=0.95, seed=21, n=2)
    assert token_ids(llm, seeded) == token_ids(plain, seeded)


# -- EAGLE-3 heads -----------------------------------------------------------------------------


def _eagle3_head(folder, aux=(1, 2, 3), draft_vocab=256, seed=0):
    """A randomly initialised EAGLE-3 head for the built-in model, in the public checkpoint's
    layout (midlayer.*, fc, d2t mapping draft ids to every other target id)."""
    import json

    import torch
    from safetensors.torch import save_file

    h, heads, kv, d, inner = 64, 8, 4, 8, 96
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.input_layernorm.weight": 1 + w(h),
        "midlayer.hidden_norm.weight": 1 + w(h),
        "midlayer.post_attention_layernorm.weight": 1 + w(h),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * d),
        "midlayer.mlp.gate_proj.weight": w(inner, h),
        "midlayer.mlp.up_proj.weight": w(inner, h),
        "midlayer.mlp.down_proj.weight": w(h, inner),
        "norm.weight": 1 + w(h),
        "lm_head.weight": w(draft_vocab, h),
        "d2t": torch.arange(draft_vocab),  # draft id i is target id 2i
        "t2d": torch.zeros(512, dtype=torch.bool),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inner,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": d,
        "vocab_size": 512,
        "draft_vocab_size": draft_vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_an_eagle3_head_that_does_not_fit_the_target_is_refused(tmp_path):
    head = _eagle3_head(tmp_path / "eagle3", aux=(1, 2, 9))
    with pytest.raises(ValueError, match="auxiliary layers"):
        LLM(speculative_config={"method": "eagle3", "model": str(head)})
    with pytest.raises(ValueError, match="config.json"):
        LLM(speculative_config={"method": "eagle3", "model": str(tmp_path)})


def test_an_eagle3_head_keeps_the_targets_output(plain: LLM, tmp_path):
    """A random head drafts (its drafts are mostly wrong); the output is the target's, greedy
    and seeded, with chunked prefill, a small pool that preempts, and prefix-cache hits."""
    head = _eagle3_head(tmp_path / "eagle3")
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(
        speculative_config=spec, max_num_batched_tokens=7, kv_cache_memory=24 * 16 * 1536, max_num_seqs=8
    )
    assert llm.engine.runner.eagle is not None and llm.engine.runner.model.capture_layers == (1, 2, 3)
    greedy = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    prompts = PROMPTS * 2
    assert token_ids(llm, greedy, prompts) == token_ids(plain, greedy, prompts)
    seeded = SamplingParams(max_tokens=40, temperature=0.9, seed=5, n=2)
    assert token_ids(llm, seeded) == token_ids(plain, seeded)
    assert token_ids(llm, greedy, PROMPTS[:1]) == token_ids(plain, greedy, PROMPTS[:1])
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_draft_tokens > 100
    unseeded = SamplingParams(max_tokens=30, temperature=1.0, n=2)  # rejection sampling of its draws
    assert all(
        len(c.token_ids) == 30 or c.finish_reason == "stop"
        for o in llm.generate(PROMPTS, unseeded)
        for c in o.outputs
    )


def _eagle3_reference(folder, tokens: list[int]):
    """The head's normed output at the last position the target computed, for a sequence whose
    last token was just sampled: the EAGLE-3 arithmetic written out on transformers' hidden
    states of the target (features from the residual stream entering layers 1-3 through fc,
    each next token's embedding, one layer over 2 x hidden inputs)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dolmus.config import DEFAULT_MODEL_DIR

    w = load_file(str(folder / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    computed = tokens[:-1]
    with torch.no_grad():
        hidden = hf(torch.tensor([computed]), output_hidden_states=True).hidden_states  # [i]: into layer i
        feature = torch.cat([hidden[i][0] for i in (1, 2, 3)], -1) @ w["fc.weight"].T
        embeds = hf.model.embed_tokens(torch.tensor(tokens[1:]))

        def rms(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight

        normed = (
            rms(embeds, w["midlayer.input_layernorm.weight"]),
            rms(feature, w["midlayer.hidden_norm.weight"]),
        )
        x = torch.cat(normed, -1)
        n, heads, kv, d = len(computed), 8, 4, 8
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv, d).transpose(0, 1)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv, d).transpose(0, 1)
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.arange(n).float()[:, None] * inv[None, :]
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

        def rope(t):
            return t * cos + torch.cat((-t[..., d // 2 :], t[..., : d // 2]), -1) * sin

        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        residual = (
            feature + attn.transpose(0, 1).reshape(n, heads * d) @ w["midlayer.self_attn.o_proj.weight"].T
        )
        h = rms(residual, w["midlayer.post_attention_layernorm.weight"])
        gate, up = h @ w["midlayer.mlp.gate_proj.weight"].T, h @ w["midlayer.mlp.up_proj.weight"].T
        out = residual + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        return rms(out, w["norm.weight"])[-1], w


def test_the_eagle3_head_computes_what_the_layout_says(tmp_path):
    """After the prefill and after steps whose windows were partly rejected, the head's state
    at the last computed position is the reference arithmetic over the whole sequence: its KV
    holds the target's features wherever the target kept a position."""
    import torch

    folder = _eagle3_head(tmp_path / "eagle3", seed=4)
    llm = LLM(speculative_config={"method": "eagle3", "model": str(folder), "adaptive": False})
    runner = llm.engine.runner
    prompt = llm.tokenizer.encode(PROMPTS[1])
    llm.engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for step in range(6):
        llm.engine.step()
        ((rid, seq),) = runner.sequences.items()
        normed, _, position = runner.eagle.last[rid]
        assert position == len(seq.token_ids) - 2
        expected, w = _eagle3_reference(folder, seq.token_ids)
        assert torch.allclose(normed.float(), expected, atol=1e-4), step
    assert llm.engine.stats().spec_num_drafts >= 5  # a window in every step after the prefill
    logits = runner.eagle.head.compute_logits(normed.unsqueeze(0))[0]
    assert int(logits.argmax()) == 2 * int((expected @ w["lm_head.weight"].T).argmax())  # d2t: i is 2i
    assert torch.isinf(logits[1::2]).all()  # odd ids are outside the draft vocabulary
