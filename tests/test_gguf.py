"""GGUF files: `dolmus convert --to gguf` and loading them back (`--model file.gguf`)."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from conftest import TOKENIZER_FILES, build_model_dir
from safetensors.torch import save_file

from dolmus import LLM, SamplingParams
from dolmus.cli import main
from dolmus.config import DEFAULT_MODEL_DIR, EngineConfig, ModelConfig
from dolmus.quant.gguf_blocks import BlockCodes
from dolmus.runtime import native as native_build
from dolmus.runtime.gguf_loader import hf_to_gguf_name, iter_gguf_weights
from dolmus.runtime.layers.linear import Linear
from helpers import gguf_raw_blocks, random_prompts, run_tokens

STORY_PROMPTS = ["Once upon a time", "The little dog ran", "Lily and Tom went to the"]


def _convert(src, out, kind: str) -> None:
    assert main(["convert", str(src), "--to", "gguf", "--out", str(out), "--type", kind]) == 0


def _texts(llm: LLM) -> list[str]:
    return [
        o.outputs[0].text for o in llm.generate(STORY_PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    ]


def test_loading_a_gguf_parses_its_metadata_once(tmp_path, monkeypatch) -> None:
    """Config, tokenizer (both through transformers) and weights share one parsed reader:
    parsing the metadata is what made opening a chat model's GGUF take seconds."""
    import gguf.gguf_reader

    out = tmp_path / "stories.gguf"
    _convert(DEFAULT_MODEL_DIR, out, "f32")
    parses = []
    real_init = gguf.gguf_reader.GGUFReader.__init__

    def counting_init(self, path, *args, **kwargs):
        parses.append(str(path))
        real_init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.gguf_reader.GGUFReader, "__init__", counting_init)
    llm = LLM(model=str(out), dtype="float32")
    assert len(parses) == 1
    assert _texts(llm) == _texts(LLM(dtype="float32"))


def test_stories260k_round_trip(tmp_path) -> None:
    reference = _texts(LLM(dtype="float32"))
    for kind in ("f32", "q8_0"):  # q8_0: the same greedy story from 8-bit blocks
        out = tmp_path / f"stories-{kind}.gguf"
        _convert(DEFAULT_MODEL_DIR, out, kind)
        llm = LLM(model=str(out), dtype="float32")
        assert llm.engine.model_config.architecture == "LlamaForCausalLM"
        assert llm.tokenizer.encode("Once upon a time") == LLM().tokenizer.encode("Once upon a time")
        assert _texts(llm) == reference


def test_a_quantized_gguf_runs_in_bf16_where_the_cpu_has_bf16(tmp_path) -> None:
    """`dtype auto`: an F32 file stays float32; a quantized one runs bf16 on a CPU with bf16
    instructions and float32 on one without (bf16 emulated there, our kernels float32)."""
    cpu = torch.device("cpu")
    for kind, file_dtype in (("f32", torch.float32), ("q8_0", torch.bfloat16)):
        out = tmp_path / f"stories-{kind}.gguf"
        _convert(DEFAULT_MODEL_DIR, out, kind)
        config = ModelConfig.from_dir(out)
        assert config.dtype == file_dtype
        engine_config = EngineConfig(model=str(out))
        assert engine_config.resolve_dtype(config.dtype, cpu, cpu_has_bf16=False) == torch.float32
        expected = torch.bfloat16 if kind == "q8_0" else torch.float32
        assert engine_config.resolve_dtype(config.dtype, cpu, cpu_has_bf16=True) == expected
        assert EngineConfig(model=str(out), dtype="float32").resolve_dtype(config.dtype, cpu) == torch.float32
    llm = LLM(model=str(out))  # the q8_0 file, on this machine's CPU
    assert llm.engine.dtype == (torch.bfloat16 if native_build.cpu_has_bf16() else torch.float32)
    assert all(o.outputs[0].text for o in llm.generate(STORY_PROMPTS, SamplingParams(max_tokens=8)))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_quantized_gguf_equals_its_dequantized_weights(tmp_path, model_root, arch) -> None:
    src = build_model_dir(arch, model_root)
    prompts = random_prompts(seed=6)
    f32 = tmp_path / "f32.gguf"
    _convert(src, f32, "f32")
    assert run_tokens(LLM(model=str(f32), dtype="float32"), prompts) == run_tokens(
        LLM(model=str(src), dtype="float32"), prompts
    )
    q4 = tmp_path / "q4_0.gguf"
    _convert(src, q4, "q4_0")
    # A float Hugging Face folder holding exactly the weights the Q4_0 blocks decode to.
    cfg = ModelConfig.from_dir(src)
    folder = tmp_path / "dequantized"
    folder.mkdir()
    weights = dict(iter_gguf_weights(q4, cfg.architecture, cfg.num_heads, cfg.num_kv_heads))
    # Linear weights keep their Q4_0 blocks; they decode to what the gguf package decodes.
    reader = gguf.GGUFReader(str(q4))
    by_gguf_name = {hf_to_gguf_name(name): name for name in weights}
    kept = 0
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_0:
            name = by_gguf_name[t.name]
            expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
            if name.endswith("_proj.weight"):
                assert isinstance(weights[name], BlockCodes)
                assert torch.equal(weights[name].dequantize(), expected.reshape(weights[name].shape))
                kept += 1
            else:  # the embedding: a float table
                assert torch.equal(weights[name], expected.reshape(weights[name].shape))
    assert kept >= 7 * 2  # every linear layer
    floats = {
        k: (v.dequantize() if isinstance(v, BlockCodes) else v).contiguous() for k, v in weights.items()
    }
    save_file(floats, folder / "model.safetensors")
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(src / name, folder / name)
    assert run_tokens(LLM(model=str(q4), dtype="float32"), prompts) == run_tokens(
        LLM(model=str(folder), dtype="float32"), prompts
    )
    if native_build.cpu_supported() and native_build.find_compiler() is not None:
        # bf16: the codes run as stored on our int4 kernel, agreeing with the decoded weights.
        ours = LLM(model=str(q4), dtype="bfloat16")
        linears = [m for m in ours.engine.runner.model.modules() if isinstance(m, Linear)]
        assert all(
            m.checkpoint_layout == "int4 kernel" for m in linears if m is not ours.engine.runner.model.lm_head
        )
        ids = prompts[4]
        a = ours.engine.prompt_logprobs(ids, chunk_size=1).float()
        b = LLM(model=str(folder), dtype="bfloat16").engine.prompt_logprobs(ids, chunk_size=1).float()
        assert (a.exp() * (a - b)).sum(-1).mean() < 5e-3


def test_convert_refuses_what_it_cannot_write(tmp_path, capsys, model_root) -> None:
    rope_scaled = build_model_dir("llama", model_root)  # llama3 rope scaling
    assert main(["convert", str(rope_scaled), "--out", str(tmp_path / "x.gguf")]) == 2
    assert "rope scaling" in capsys.readouterr().err
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="GGUF"):
        LLM(model=str(tmp_path / "bad.gguf"))


def _q4_k_blocks(w: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """Pack [N, K] (K a multiple of 256) as llama.cpp's Q4_K: 144-byte super-blocks of an fp16
    scale d and min dmin, twelve bytes of 6-bit sub-block scales and mins (eight blocks of 32),
    and 128 bytes of 4-bit codes; w = d * sc * q - dmin * m. Returns (bytes [N, K/256*144],
    the weights those bytes decode to)."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 8, 32)
    low, high = sub.amin(-1), sub.amax(-1)
    scale, mins = ((high - low) / 15).clamp(min=1e-8), (-low).clamp(min=0)
    d = (scale.amax(-1) / 63).half().float().clamp(min=2**-14)
    dmin = (mins.amax(-1) / 63).half().float().clamp(min=2**-14)
    sc = torch.round(scale / d[..., None]).clamp(1, 63).long()
    m = torch.round(mins / dmin[..., None]).clamp(0, 63).long()
    step, offset = d[..., None] * sc.float(), dmin[..., None] * m.float()
    q = torch.round((sub + offset[..., None]) / step[..., None]).clamp(0, 15).long()
    decoded = (step[..., None] * q.float() - offset[..., None]).reshape(n, k)
    scales = torch.cat(
        [
            sc[..., :4] | (sc[..., 4:] >> 4) << 6,
            m[..., :4] | (m[..., 4:] >> 4) << 6,
            (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4,
        ],
        dim=-1,
    ).to(torch.uint8)
    pairs = q.reshape(n, k // 256, 4, 2, 32)  # 64 weights per 32 bytes: the first 32 in low nibbles
    qs = (pairs[:, :, :, 0] | pairs[:, :, :, 1] << 4).reshape(n, k // 256, 128).to(torch.uint8)
    header = torch.stack([d, dmin], -1).half().view(torch.uint8)  # [n, blocks, 4]
    blocks = torch.cat([header, scales, qs], dim=-1)
    return blocks.reshape(n, -1).numpy(), decoded


def test_a_k_quant_mix_runs_as_stored(tmp_path) -> None:
    """A mixed file as llama.cpp's K-quant presets make them (rows of 256): Q4_K, Q5_K and Q6_K
    linears, q/k/v of different types fused into one layer, a Q6_K tied embedding.
    Every linear layer, the head included, keeps its blocks where the kernels run, and the
    greedy tokens are those of the weights the gguf package decodes."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    src = tmp_path / "qwen2-256"
    torch.manual_seed(7)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(src)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, src / name)
    f32 = tmp_path / "f32.gguf"
    _convert(src, f32, "f32")
    # Rewrite it with the gguf package: same metadata, linear weights quantized.
    reader = gguf.GGUFReader(str(f32))
    arch = reader.get_field("general.architecture").contents()
    out = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    types = {
        "attn_q": "Q4_K",
        "attn_k": "Q4_K",
        "attn_v": "Q6_K",
        "attn_output": "Q5_K",
        "ffn_gate": "Q4_K",
        "ffn_up": "Q4_K",
        "ffn_down": "Q6_K",
    }
    decoded = {}
    for i, t in enumerate(reader.tensors):
        array = np.array(t.data).reshape([int(x) for x in reversed(t.shape)])
        kind = (
            types.get(t.name.split(".")[2])
            if t.name.startswith("blk.") and t.name.endswith(".weight")
            else "Q6_K"
            if t.name == "token_embd.weight"
            else None
        )
        if kind is None:
            writer.add_tensor(t.name, array)
        elif kind == "Q4_K":
            blocks, decoded[t.name] = _q4_k_blocks(torch.from_numpy(array))
            writer.add_tensor(t.name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            blocks, _ = gguf_raw_blocks(kind, array, seed=i)
            writer.add_tensor(t.name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    cfg = ModelConfig.from_dir(src)
    weights = dict(iter_gguf_weights(out, cfg.architecture, cfg.num_heads, cfg.num_kv_heads))
    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert {"Q4_K", "Q5_K", "Q6_K"} <= set(written.values())
    by_gguf_name = {hf_to_gguf_name(name): name for name in weights}
    for gguf_name, expected in decoded.items():  # Q4_K decodes to what our packing means
        got = weights[by_gguf_name[gguf_name]].dequantize()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    folder = tmp_path / "decoded"
    folder.mkdir()
    floats = {
        k: (v.dequantize() if isinstance(v, BlockCodes) else v).contiguous() for k, v in weights.items()
    }
    save_file(floats, folder / "model.safetensors")
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(src / name, folder / name)
    prompts = random_prompts(lengths=(1, 9, 40, 130), seed=8)
    ours = LLM(model=str(out), dtype="float32")
    if native_build.avx2_library() is not None:
        layouts = {m.checkpoint_layout for m in ours.engine.runner.model.modules() if isinstance(m, Linear)}
        assert layouts == {"4-bit blocks", "8-bit blocks"}  # Q4_K gate/up; the rest in bytes
    reference = LLM(model=str(folder), dtype="float32")
    assert run_tokens(ours, prompts) == run_tokens(reference, prompts)
    ids = prompts[2]
    a = ours.engine.prompt_logprobs(ids, chunk_size=7).float()
    torch.testing.assert_close(
        a, reference.engine.prompt_logprobs(ids, chunk_size=7).float(), rtol=0, atol=1e-4
    )
    # bf16 (where the CPU has it: Q4_K gate/up on our int4 kernel, the rest on the grouped int8
    # one): about as close to the float32 run as the decoded weights rounded to bf16 are
    exact = a

    def kl(other: torch.Tensor) -> float:
        return float((exact.exp() * (exact - other)).sum(-1).mean())

    a = LLM(model=str(out), dtype="bfloat16").engine.prompt_logprobs(ids, chunk_size=7).float()
    b = LLM(model=str(folder), dtype="bfloat16").engine.prompt_logprobs(ids, chunk_size=7).float()
    # (random codes with bf16 scales and minima that nearly cancel: ~2x here, ~1x on real files)
    assert kl(a) < 3 * kl(b) + 1e-3


def test_a_gguf_tokenizer_is_built_once_and_cached(tmp_path, monkeypatch) -> None:
    """The second load reads the saved tokenizer (same tokens, same specials); a damaged
    cache entry is rebuilt, not fatal."""
    from dolmus.runtime.gguf_loader import _tokenizer_cache_dir, gguf_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "stories.gguf"
    _convert(DEFAULT_MODEL_DIR, out, "q8_0")
    entry = _tokenizer_cache_dir(out)
    assert entry is not None and not entry.exists()
    built = gguf_tokenizer(out)
    assert (entry / "tokenizer.json").is_file()
    cached = gguf_tokenizer(out)
    text = "Once upon a time, Lily's dog ran."
    assert cached.encode(text) == built.encode(text)
    assert (cached.bos_token, cached.eos_token, len(cached)) == (built.bos_token, built.eos_token, len(built))
    (entry / "tokenizer.json").write_text("{broken")
    assert gguf_tokenizer(out).encode(text) == built.encode(text)
    assert LLM(model=str(out), dtype="float32").tokenizer.encode(text) == built.encode(text)


def test_a_cached_tokenizer_keeps_the_pipeline_built_from_the_file(tmp_path, monkeypatch, model_root) -> None:
    """A Qwen2 file carrying a SentencePiece vocabulary: transformers' Qwen2Tokenizer class
    would lay its own byte-level pre-tokenizer over the cached copy; the cache must encode as
    the tokenizer built from the file did (else a second start tokenizes differently)."""
    from dolmus.runtime.gguf_loader import gguf_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "qwen2.gguf"
    _convert(build_model_dir("qwen2", model_root), out, "q8_0")
    text = "Once upon a time, Lily's dog ran.\n\nThe  end"
    assert gguf_tokenizer(out).encode(text) == gguf_tokenizer(out).encode(text)
