"""GGUF Mixture-of-Experts files: Mixtral (llama.cpp's "llama" with experts), Qwen2-MoE (a shared
expert with its gate) and Qwen3-MoE, written by `dolmus convert` in llama.cpp's layout (stacked
experts), load to transformers' greedy tokens and logits; Q8_0 experts load too."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import TOKENIZER_FILES
from safetensors.torch import save_file

from dolmus import LLM
from dolmus.cli import main
from dolmus.config import DEFAULT_MODEL_DIR, ModelConfig
from dolmus.quant.experts import QuantizedExpertWeights
from dolmus.quant.gguf_blocks import BlockCodes
from dolmus.runtime import native as native_build
from dolmus.runtime.gguf_loader import iter_gguf_weights
from dolmus.runtime.layers.fused_moe import FusedExperts
from tests.helpers import greedy, hf_greedy, hf_logprobs, random_prompts, run_tokens


def _config(arch: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=4)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(
            **common, num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=96,
            norm_topk_prob=False,
        )  # fmt: skip
    return Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=64, norm_topk_prob=True)


def _source(arch: str, root: Path) -> Path:
    from transformers import AutoModelForCausalLM

    folder = root / arch
    if not folder.exists():
        torch.manual_seed(2)
        AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32).save_pretrained(folder)
        for name in TOKENIZER_FILES:
            shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


def _convert(src: Path, out: Path, kind: str) -> Path:
    assert main(["convert", str(src), "--to", "gguf", "--out", str(out), "--type", kind]) == 0
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-moe")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_f32_moe_gguf_equals_transformers(root: Path, arch: str) -> None:
    src = _source(arch, root)
    out = _convert(src, root / f"{arch}-f32.gguf", "f32")
    reader = gguf.GGUFReader(str(out))
    expected_arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[arch]
    assert reader.get_field("general.architecture").contents() == expected_arch
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    inner = 96 if arch == "mixtral" else 64
    assert shapes["blk.0.ffn_gate_exps.weight"] == (4, inner, 64)  # [experts, rows, inputs]
    assert shapes["blk.0.ffn_down_exps.weight"] == (4, 64, inner)
    assert shapes["blk.0.ffn_gate_inp.weight"] == (4, 64)
    if arch == "qwen2_moe":
        assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == (64,)
        assert shapes["blk.0.ffn_up_shexp.weight"] == (96, 64)

    llm = LLM(model=str(out), dtype="float32")
    expected = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
    assert llm.engine.model_config.architecture == expected.get(arch, "Qwen3MoeForCausalLM")
    prompts = random_prompts((1, 6, 19, 45), seed=9)
    assert run_tokens(llm, prompts, greedy(20)) == [hf_greedy(src, p, 20) for p in prompts]
    ids = prompts[-1]
    torch.testing.assert_close(llm.engine.prompt_logprobs(ids), hf_logprobs(src, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_transformers_reads_our_moe_files_as_llama_cpp_layouts(root: Path, arch: str) -> None:
    """An oracle for the layout independent of our loader: transformers' own GGUF reader (which
    follows llama.cpp's names and shapes) recovers the source model's tensors from the file."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = _source(arch, root)
    out = root / f"{arch}-f32.gguf"
    if not out.exists():
        _convert(src, out, "f32")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    loaded = load_gguf_checkpoint(str(out), return_tensors=True, model_to_load=model)["tensors"]
    state = model.state_dict()
    assert any("experts" in name for name in loaded)
    assert set(loaded) == set(state)
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor.float(), state[name], rtol=0, atol=0, msg=name)


def test_q8_0_experts_load_and_stay_close(root: Path, tmp_path: Path) -> None:
    """Q8_0 stacked experts (and Q8_0 linears) decode on load: the engine computes exactly with
    the gguf package's decoded weights, and stays near the float model."""
    arch = "qwen2_moe"
    src = _source(arch, root)
    out = _convert(src, tmp_path / "q8_0.gguf", "q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q8_0" and types["blk.1.ffn_down_exps.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"  # routers stay float, as llama.cpp keeps them

    # A float Hugging Face folder of exactly the decoded weights.
    cfg = ModelConfig.from_dir(out)
    weights = dict(iter_gguf_weights(out, cfg.architecture, cfg.num_heads, cfg.num_kv_heads))
    experts = [n for n in weights if ".experts." in n]
    assert len(experts) == 2 * 4 * 3
    folder = tmp_path / "decoded"
    folder.mkdir()
    floats = {
        k: (v.dequantize() if isinstance(v, BlockCodes) else v).contiguous() for k, v in weights.items()
    }
    save_file(floats, folder / "model.safetensors")
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(src / name, folder / name)

    prompts = random_prompts((1, 8, 30), seed=10)
    ours = LLM(model=str(out), dtype="float32")
    reference = LLM(model=str(folder), dtype="float32")
    assert run_tokens(ours, prompts, greedy(16)) == run_tokens(reference, prompts, greedy(16))
    ids = prompts[-1]
    a = ours.engine.prompt_logprobs(ids)
    torch.testing.assert_close(a, reference.engine.prompt_logprobs(ids), atol=1e-4, rtol=0)
    # ... and near the float32 model: 8-bit rounding moves the log-probabilities a little
    exact = hf_logprobs(src, ids)
    assert float((exact.exp() * (exact - a)).sum(-1).mean()) < 1e-3

    if native_build.avx2_library() is not None:  # the blocks run as stored, as dense layers' do
        assert {type(m).__name__ for m in _matrices(ours)} == {"BlockMatrix"}


def _matrices(llm: LLM) -> list:
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    assert layers and all(isinstance(m.weights, QuantizedExpertWeights) for m in layers)
    return [m for layer in layers for m in (*layer.weights.w13, *layer.weights.w2)]


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_expert_blocks_run_on_the_dense_layers_kernels(root: Path, tmp_path: Path, kind: str) -> None:
    """Each expert matrix takes the kernel a dense layer of its blocks would (float32: the AVX2
    block kernels; bf16: Q4_0 on the int4 kernel, Q8_0 on the grouped int8 one), computes
    with the weights the file decodes to, and holds about the file's bytes."""
    src = _source("mixtral", root)
    out = _convert(src, tmp_path / f"{kind}.gguf", kind)
    cfg = ModelConfig.from_dir(out)
    decoded = dict(iter_gguf_weights(out, cfg.architecture, cfg.num_heads, cfg.num_kv_heads))
    prompts = random_prompts((1, 12), seed=11)
    gen = torch.Generator().manual_seed(3)
    cases = [("float32", "BlockMatrix", native_build.avx2_library() is not None)]
    bf16 = native_build.cpu_supported() and native_build.library() is not None
    cases.append(("bfloat16", "KernelMatrix" if kind == "q4_0" else "GroupedInt8Matrix", bf16))
    for dtype, expected, runs in cases:
        if not runs:
            continue
        llm = LLM(model=str(out), dtype=dtype)
        assert {type(m).__name__ for m in _matrices(llm)} == {expected}
        assert all(len(t) == 6 for t in run_tokens(llm, prompts, greedy(6)))
        layer = next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts))
        w13, w2 = layer.weights.dequantize()
        # the file's decoded weights (bf16 kernels: scales and zeros rounded to bf16)
        tol = 0 if dtype == "float32" else 0.01
        for e in range(layer.num_experts):
            prefix = f"model.layers.0.mlp.experts.{e}"
            gate_up = torch.cat([decoded[f"{prefix}.{p}_proj.weight"].dequantize() for p in ("gate", "up")])
            down = decoded[f"{prefix}.down_proj.weight"].dequantize()
            for ours, file in ((w13[e], gate_up), (w2[e], down)):
                assert (ours - file).abs().max() <= tol * file.abs().max() + 1e-6
        twin = FusedExperts(layer.num_experts, 64, layer.inner, getattr(torch, dtype))
        twin.w13.data, twin.w2.data = w13.to(twin.w13.dtype), w2.to(twin.w2.dtype)
        x = torch.randn(5, 64, generator=gen).to(twin.w13.dtype)
        weights, chosen = (
            torch.rand(5, 2, generator=gen),
            torch.stack([torch.randperm(4)[:2] for _ in range(5)]),
        )
        a, b = layer(x, weights, chosen), twin(x, weights, chosen)
        assert (a - b).norm() <= (1e-5 if dtype == "float32" else 0.02) * b.norm()
        # Q8_0: 34 bytes per 32 weights (scales float32 here: 36); Q4_0 about half (and zeros)
        float_bytes = 3 * 4 * 96 * 64 * 4 * cfg.num_layers  # gate, up, down of 4 experts, fp32
        held = sum(m.state_bytes() for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts))
        assert held <= float_bytes * (0.3 if kind == "q8_0" else 0.2)


def test_quantization_requantizes_decoded_expert_blocks(root: Path, tmp_path: Path) -> None:
    """Where the blocks are decoded (no block kernel placed them: native kernels off), the
    engine's --quantization takes the decoded experts, as it takes a float checkpoint's."""
    out = _convert(_source("qwen3_moe", root), tmp_path / "q8_0.gguf", "q8_0")
    llm = LLM(model=str(out), dtype="float32", quantization="int8", native_kernels=False)
    assert {type(m.state).__name__ for m in _matrices(llm)} == {"Int8State"}
    assert all(len(t) == 8 for t in run_tokens(llm, random_prompts((1, 8), seed=4), greedy(8)))


def test_per_expert_tensors_of_early_mixtral_files_load(root: Path, tmp_path: Path) -> None:
    """llama.cpp's first Mixtral files kept one tensor per expert (blk.N.ffn_gate.E.weight):
    the same model rewritten that way gives the same log-probabilities."""
    src = _source("mixtral", root)
    stacked = _convert(src, tmp_path / "stacked.gguf", "q8_0")
    reader = gguf.GGUFReader(str(stacked))
    out = tmp_path / "per-expert.gguf"
    writer = gguf.GGUFWriter(str(out), reader.get_field("general.architecture").contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    for t in reader.tensors:
        array = np.array(t.data)
        if "_exps." not in t.name:
            writer.add_tensor(t.name, array, raw_dtype=t.tensor_type)
            continue
        blk, layer, kind, _ = t.name.split(".")
        for expert, matrix in enumerate(array):  # Q8_0 rows: [experts, rows, bytes]
            writer.add_tensor(f"{blk}.{layer}.{kind[:-5]}.{expert}.weight", matrix, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    names = {t.name for t in gguf.GGUFReader(str(out)).tensors}
    assert "blk.1.ffn_down.3.weight" in names and "blk.1.ffn_down_exps.weight" not in names
    ids = random_prompts((20,), seed=12)[0]
    a = LLM(model=str(out), dtype="float32").engine.prompt_logprobs(ids)
    torch.testing.assert_close(
        a, LLM(model=str(stacked), dtype="float32").engine.prompt_logprobs(ids), rtol=0, atol=0
    )


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_expert_blocks_over_two_ranks_give_one_ranks_tokens(root: Path, expert_parallel: bool) -> None:
    """Each rank keeps its share of the blocks as stored (a slice of every expert's inner
    features in whole blocks, or whole experts): the same weights as one rank, so the same
    tokens and logits."""
    out = root / "qwen3_moe-q8_0.gguf"
    if not out.exists():
        _convert(_source("qwen3_moe", root), out, "q8_0")
    prompts = random_prompts((3, 17, 40), seed=13)
    one = LLM(model=str(out), dtype="float32", max_num_batched_tokens=32)
    want, want_logprobs = run_tokens(one, prompts, greedy(12)), one.engine.prompt_logprobs(prompts[-1])
    two = LLM(
        model=str(out),
        dtype="float32",
        max_num_batched_tokens=32,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )
    try:
        assert run_tokens(two, prompts, greedy(12)) == want
        torch.testing.assert_close(two.engine.prompt_logprobs(prompts[-1]), want_logprobs, atol=1e-4, rtol=0)
    finally:
        two.engine.shutdown()
