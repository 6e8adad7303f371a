"""Medusa heads as a speculative proposer: the output is the target's with the heads on or off.

The heads are fitted in the fixture, on transformers' hidden states of the target's own greedy
continuations (random residual blocks, each LM head solved by least squares so that head j maps
the final hidden state at position p to the token at p + 2 + j): on those prompts every greedy
draft is right, which only holds if the runner keeps the hidden state of the right row and
position and the heads compute what the checkpoint says. Other prompts get mostly wrong drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dolmus import LLM, SamplingParams
from tests.helpers import greedy, hf_greedy, random_prompts, run_tokens

NUM_HEADS, NUM_LAYERS, NEW = 3, 1, 14
HEAD = random_prompts((16,), seed=11)[0]  # one full KV block the prompts share
PROMPTS = random_prompts((3, 7, 11), seed=12, prefix=HEAD)
SPEC = {"method": "medusa", "num_speculative_tokens": NUM_HEADS, "adaptive": False}


def _hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _blocks(x: torch.Tensor, tensors: dict, head: int) -> torch.Tensor:
    for j in range(NUM_LAYERS):
        w, b = tensors[f"blocks.{head}.layers.{j}.weight"], tensors[f"blocks.{head}.layers.{j}.bias"]
        x = x + torch.nn.functional.silu(x @ w.T + b)
    return x


@torch.no_grad()
def _fit_heads(target: Path) -> tuple[dict[str, torch.Tensor], list[list[int]], float]:
    """vLLM-named tensors of heads fitted to the target's greedy continuations of PROMPTS, those
    continuations, and the smallest gap between the target's top two logits along them."""
    hf = _hf(target)
    hidden_size, vocab = hf.config.hidden_size, hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(NUM_HEADS):
        for j in range(NUM_LAYERS):
            tensors[f"blocks.{i}.layers.{j}.weight"] = (
                torch.randn(hidden_size, hidden_size, generator=gen) * 0.1
            )
            tensors[f"blocks.{i}.layers.{j}.bias"] = torch.randn(hidden_size, generator=gen) * 0.1
    features: list[list[torch.Tensor]] = [[] for _ in range(NUM_HEADS)]
    wanted: list[list[int]] = [[] for _ in range(NUM_HEADS)]
    outputs, gap = [], float("inf")
    for prompt in PROMPTS:
        out = hf_greedy(target, prompt, NEW)
        outputs.append(out)
        seq = prompt + out
        hidden = hf.model(torch.tensor([seq[:-1]])).last_hidden_state[0]  # after the final norm
        top = hf.lm_head(hidden[len(prompt) - 1 :]).topk(2).values
        gap = min(gap, float((top[:, 0] - top[:, 1]).min()))
        for i in range(NUM_HEADS):
            for p in range(len(prompt) - 1, len(seq) - 2 - i):
                features[i].append(_blocks(hidden[p], tensors, i))
                wanted[i].append(seq[p + 2 + i])
    for i in range(NUM_HEADS):
        x = torch.stack(features[i])  # fewer points than dimensions: solved exactly
        assert x.shape[0] < hidden_size
        y = torch.zeros(x.shape[0], vocab)
        y[torch.arange(x.shape[0]), torch.tensor(wanted[i])] = 10.0
        tensors[f"lm_heads.{i}.weight"] = torch.linalg.lstsq(x, y).solution.T.contiguous()
    return tensors, outputs, gap


def _write(folder: Path, tensors: dict, config: dict, torch_file: str | None = None) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if torch_file:
        torch.save(tensors, folder / torch_file)
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _vllm_config(hidden_size: int = 64, **extra) -> dict:
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": hidden_size,
        "vocab_size": 512,
        "num_heads": NUM_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        **extra,
    }


def _faster_decoding_names(tensors: dict) -> dict:
    renamed = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[0] == "blocks":  # blocks.i.layers.j.kind -> medusa_head.i.j.linear.kind
            renamed[f"medusa_head.{parts[1]}.{parts[3]}.linear.{parts[4]}"] = t
        else:  # lm_heads.i.weight -> medusa_head.i.{num_layers}.weight
            renamed[f"medusa_head.{parts[1]}.{NUM_LAYERS}.weight"] = t
    return renamed


@pytest.fixture(scope="module")
def fitted(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    tensors, outputs, gap = _fit_heads(llama_dir)
    folder = _write(tmp_path_factory.mktemp("medusa") / "heads", tensors, _vllm_config())
    return folder, tensors, outputs, gap


@pytest.fixture(scope="module")
def plain(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32")


def _medusa(llama_dir: Path, heads: Path, **engine) -> LLM:
    return LLM(str(llama_dir), dtype="float32", speculative_config={**SPEC, "model": str(heads)}, **engine)


def test_fitted_heads_draft_the_targets_tokens(llama_dir: Path, fitted, plain: LLM):
    """Greedy: the tokens are transformers' and every draft of a fitted head is accepted."""
    heads, _, outputs, _ = fitted
    llm = _medusa(llama_dir, heads)
    assert llm.engine.runner.medusa is not None
    assert run_tokens(llm, PROMPTS, greedy(NEW)) == outputs == run_tokens(plain, PROMPTS, greedy(NEW))
    stats = llm.engine.stats()
    # most of each prompt's 13 tokens after the prefill's were drafts (windows grow from 2 to 3
    # drafts as the request's acceptance rate rises)
    assert stats.spec_num_draft_tokens > len(PROMPTS) * NEW // 2
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert len(stats.spec_accepted_per_position) == NUM_HEADS and min(stats.spec_accepted_per_position) > 0


def test_the_output_is_the_targets_across_features(llama_dir: Path, fitted, plain: LLM):
    """Chunked prefill of 8 tokens, a pool small enough to preempt, prefix-cache hits, n = 2,
    prompts the heads were not fitted on, penalties and seeded sampling."""
    heads = fitted[0]
    # 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes = 512 bytes a token; 7 blocks of 16
    llm = _medusa(llama_dir, heads, max_num_batched_tokens=8, kv_cache_memory=512 * 16 * 7, max_num_seqs=6)
    prompts = PROMPTS + random_prompts((5, 30), seed=13)
    params = greedy(24, n=2)
    assert run_tokens(llm, prompts, params) == run_tokens(plain, prompts, params)
    penalised = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3, min_tokens=10)
    assert run_tokens(llm, prompts, penalised) == run_tokens(plain, prompts, penalised)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, n=2)
    assert run_tokens(llm, prompts, seeded) == run_tokens(plain, prompts, seeded)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_unseeded_sampling_verifies_the_heads_draws_by_rejection(llama_dir: Path, fitted):
    """Unseeded sampled requests draw their drafts from the heads' distributions and are verified
    by rejection sampling. At a temperature far below the target's smallest logit gap along the
    fitted continuations both distributions sit on one token: the drafts are accepted and the
    output is the greedy one. At temperature 1 the windows are still checked token by token."""
    heads, _, outputs, gap = fitted
    llm = _medusa(llama_dir, heads)
    cold = SamplingParams(max_tokens=NEW, temperature=gap / 40, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, cold)
    assert [o.outputs[0].token_ids for o in outs] == outputs
    for o in outs:
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > len(PROMPTS) * NEW // 2
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    warm = SamplingParams(max_tokens=20, temperature=1.0, n=2, ignore_eos=True)
    assert all(len(c.token_ids) == 20 for o in llm.generate(PROMPTS, warm) for c in o.outputs)
    assert llm.engine.stats().spec_num_draft_tokens > stats.spec_num_draft_tokens


@torch.no_grad()
def test_the_heads_read_the_targets_final_hidden_state(llama_dir: Path, fitted):
    """After the prefill and after each window (fully accepted for a fitted prompt, mostly
    rejected for another, batched together), the kept state is transformers' final hidden state
    at the position before the last token, and the heads' logits on it are the residual blocks
    and LM heads of the checkpoint written out."""
    heads, tensors, _, _ = fitted
    llm = _medusa(llama_dir, heads)
    runner = llm.engine.runner
    hf = _hf(llama_dir)
    llm.engine.add_request("fitted", PROMPTS[0], greedy(NEW))
    llm.engine.add_request("other", random_prompts((9,), seed=14)[0], greedy(NEW))
    for _ in range(3):
        llm.engine.step()
        assert len(runner.sequences) == 2
        for rid, seq in runner.sequences.items():
            drafter = runner.medusa
            assert drafter.position[rid] == len(seq.token_ids) - 2
            kept = drafter.hidden[seq.row]
            expected = hf.model(torch.tensor([seq.token_ids[:-1]])).last_hidden_state[0, -1]
            torch.testing.assert_close(kept, expected, atol=1e-4, rtol=0)
            logits = drafter.heads(kept.unsqueeze(0), NUM_HEADS)[:, 0]
            for i in range(NUM_HEADS):
                reference = _blocks(expected, tensors, i) @ tensors[f"lm_heads.{i}.weight"].T
                torch.testing.assert_close(logits[i], reference, atol=1e-3, rtol=0)
    stats = llm.engine.stats()
    assert stats.spec_num_drafts == 4 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_faster_decoding_layout_and_a_shared_lm_head(llama_dir: Path, fitted, plain: LLM, tmp_path):
    """FasterDecoding's names in a torch file load to the same heads; original_lm_head without
    a tensor of its own shares the target's LM head (a draft of the target's next token again)."""
    from dolmus.config import ModelConfig
    from dolmus.quant.methods import make_linear_method
    from dolmus.runtime.models.medusa import load_medusa

    heads, tensors, _, _ = fitted
    old = _write(
        tmp_path / "faster",
        _faster_decoding_names(tensors),
        {"medusa_num_heads": NUM_HEADS, "medusa_num_layers": NUM_LAYERS, "base_model_name_or_path": "x"},
        torch_file="medusa_lm_head.pt",
    )
    target = ModelConfig.from_dir(llama_dir)

    def load(folder: Path, k: int = NUM_HEADS):
        return load_medusa(folder, target, k, torch.float32, torch.device("cpu"), make_linear_method(False))

    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(load(old)(x, NUM_HEADS), load(heads)(x, NUM_HEADS))

    blocks = {n: t for n, t in tensors.items() if n.startswith("blocks.")}
    shared = _write(tmp_path / "shared", blocks, _vllm_config(original_lm_head=True, medusa_fc_bias=True))
    llm = _medusa(llama_dir, shared)
    assert not llm.engine.runner.medusa.heads.lm_heads
    prompts = PROMPTS + random_prompts((5, 30), seed=13)
    assert run_tokens(llm, prompts, greedy(20)) == run_tokens(plain, prompts, greedy(20))
    assert llm.engine.stats().spec_num_draft_tokens > 0


def test_a_truncated_vocabulary_maps_back_to_the_targets(llama_dir: Path, fitted, tmp_path):
    from dolmus.config import ModelConfig
    from dolmus.quant.methods import make_linear_method
    from dolmus.runtime.models.medusa import load_medusa

    tensors = dict(fitted[1])
    token_map = torch.arange(0, 512, 2)  # draft id i is target id 2i
    tensors["lm_heads.0.weight"] = tensors["lm_heads.0.weight"][token_map]  # cut to the kept ids
    tensors["token_map"] = token_map  # the other heads keep full rows: cut on load
    folder = _write(tmp_path / "truncated", tensors, _vllm_config(truncated_vocab_size=256))
    target = ModelConfig.from_dir(llama_dir)
    heads = load_medusa(folder, target, 2, torch.float32, torch.device("cpu"), make_linear_method(False))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    logits = heads(x, NUM_HEADS)
    assert logits.shape == (NUM_HEADS, 4, 512) and torch.isinf(logits[..., 1::2]).all()
    for i in range(NUM_HEADS):
        full = _blocks(x, fitted[1], i) @ fitted[1][f"lm_heads.{i}.weight"].T
        torch.testing.assert_close(logits[i, :, ::2], full[:, ::2], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="token_map"):
        del tensors["token_map"]
        load_medusa(
            _write(tmp_path / "no_map", tensors, _vllm_config(truncated_vocab_size=256)),
            target,
            2,
            torch.float32,
            torch.device("cpu"),
            make_linear_method(False),
        )


def test_heads_that_do_not_fit_the_target_are_refused(llama_dir: Path, fitted, tmp_path):
    from dolmus.config import EngineConfig

    tensors = fitted[1]
    narrow = {n: t[..., :32] if n.startswith("lm_heads") else t[:32, :32] if t.dim() == 2 else t[:32]
              for n, t in tensors.items()}  # fmt: skip
    cases = [
        (_write(tmp_path / "h32", narrow, _vllm_config(hidden_size=32)), "hidden states of size 32"),
        (  # no hidden_size in FasterDecoding's config: the tensors' shapes tell
            _write(
                tmp_path / "h32fd",
                _faster_decoding_names(narrow),
                {"medusa_num_heads": NUM_HEADS, "medusa_num_layers": NUM_LAYERS},
            ),
            "does not fit",
        ),
        (_write(tmp_path / "v", tensors, _vllm_config(vocab_size=1000)), "vocabulary"),
        (_write(tmp_path / "two", tensors, _vllm_config(num_heads=2)), "more than the Medusa"),
        (
            _write(
                tmp_path / "lacks",
                {n: t for n, t in tensors.items() if n != "lm_heads.2.weight"},
                _vllm_config(),
            ),
            "lacks lm_heads.2.weight",
        ),
        (tmp_path, "config.json"),
    ]
    for folder, message in cases:
        with pytest.raises(ValueError, match=message):
            _medusa(llama_dir, folder)
    with pytest.raises(ValueError, match="'model'"):
        EngineConfig(speculative_config={"method": "medusa"})


def test_the_cli_takes_medusa_like_the_other_methods(fitted):
    from dolmus.cli import build_parser
    from dolmus.engine_args import engine_config_from_args

    heads = str(fitted[0])
    text = json.dumps({"method": "medusa", "model": heads, "num_speculative_tokens": 2})
    args = build_parser().parse_args(["serve", "--speculative-config", text])
    spec = engine_config_from_args(args).speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("medusa", heads, 2)


def test_windows_run_in_the_fused_decode_step_with_the_modules_bits(model_root: Path, tmp_path):
    """The fused decode step (int8 weights on our kernels) returns the final hidden states the
    heads read, as the modules do: the same tokens and log-probabilities either way."""
    from conftest import build_model_dir

    from dolmus.runtime import native

    if not native.cpu_supported() or native.find_compiler() is None:
        pytest.skip("the fused decode step needs an x86-64 CPU with AVX-512 BF16 and a C compiler")
    target = build_model_dir("llama-wide", model_root)
    tensors, _, _ = _fit_heads(target)
    heads = _write(tmp_path / "wide", tensors, _vllm_config(hidden_size=128))
    kw = dict(dtype="bfloat16", quantization="int8", speculative_config={**SPEC, "model": str(heads)})
    fused, modules = LLM(str(target), **kw), LLM(str(target), **kw, fused_decode=False)
    assert fused.engine.runner.fused_decoder is not None
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=3)
    prompts = PROMPTS + random_prompts((5, 30), seed=13)
    outputs = [
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        for llm in (fused, modules)
    ]
    assert outputs[0] == outputs[1]
    assert fused.engine.runner.fused_steps >= 5
    assert fused.engine.stats().spec_num_accepted_tokens > 0
