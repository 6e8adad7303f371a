"""Greedy tokens and logits of every architecture against transformers."""

from __future__ import annotations

import torch

from dolmus import LLM
from helpers import NEW_TOKENS, greedy, hf_greedy, hf_logprobs, random_prompts, run_tokens


def test_greedy_batch_matches_transformers(model_dir):
    prompts = random_prompts()
    llm = LLM(model=str(model_dir), dtype="float32")
    ours = run_tokens(llm, prompts)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(model_dir, prompt), f"prompt of {len(prompt)} tokens diverged"


def test_logits_match_transformers(model_dir):
    """Every output position's full distribution (log-softmax of the logits) within 1e-4."""
    vocab = 512
    prompts = random_prompts(lengths=(1, 77, 300), seed=3)
    llm = LLM(model=str(model_dir), dtype="float32")
    outs = llm.generate(prompts, greedy(max_tokens=8, logprobs=vocab))
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        ref = hf_logprobs(model_dir, prompt + completion.token_ids)
        for i, step in enumerate(completion.logprobs):
            ours = torch.tensor([step[t] for t in range(vocab)])
            expected = ref[len(prompt) - 1 + i]
            assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (len(prompt), i)
        # The chosen token's logprob is reported separately and must agree too.
        assert (
            abs(
                completion.cumulative_logprob
                - sum(float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(completion.token_ids))
            )
            < 1e-3
        )


def test_new_tokens_count_and_finish_reason(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32")
    out = llm.generate([[5, 6, 7]], greedy(max_tokens=NEW_TOKENS))[0].outputs[0]
    assert len(out.token_ids) == NEW_TOKENS
    assert out.finish_reason == "length"


def test_sharded_checkpoint_with_index(model_root, llama_dir):
    """A model saved in many safetensors shards (with model.safetensors.index.json)."""
    import shutil

    from transformers import AutoModelForCausalLM

    folder = model_root / "llama-sharded"
    if not folder.exists():
        AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).save_pretrained(
            folder, max_shard_size="60KB"
        )
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
            shutil.copy(llama_dir / name, folder / name)
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("*.safetensors"))) > 2
    prompts = random_prompts(lengths=(7, 70), seed=30)
    sharded = run_tokens(LLM(model=str(folder), dtype="float32"), prompts)
    assert sharded == run_tokens(LLM(model=str(llama_dir), dtype="float32"), prompts)


def test_last_layer_for_the_sampled_rows_alone(model_dir):
    """The last layer runs its o-projection and MLP for the rows a step samples alone (a prompt
    chunk samples from its last row at most, one short of the prompt's end from none). Prompts
    prefilled in chunks beside each other (64-token steps) give the first token the
    distribution that the full forward over the same prompt gives (prompt_logprobs, which
    computes every row)."""
    vocab = 512
    prompts = random_prompts(lengths=(5, 77, 150), seed=11)
    llm = LLM(model=str(model_dir), dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=64)
    outs = llm.generate(prompts, greedy(max_tokens=1, logprobs=vocab))
    for prompt, out in zip(prompts, outs):
        first = out.outputs[0].logprobs[0]
        ours = torch.tensor([first[t] for t in range(vocab)])
        full = llm.engine.prompt_logprobs(prompt)[-1]
        assert torch.allclose(ours, full, atol=1e-5, rtol=0), len(prompt)
