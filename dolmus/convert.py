"""`dolmus convert --to gguf`: write a Hugging Face folder as a llama.cpp GGUF file.

Llama, Mistral (both as GGUF "llama"), Qwen2 and Qwen3 with a SentencePiece tokenizer
(tokenizer.model). Tensor types: f32, f16, bf16, or q8_0 / q4_0 / q4_1 for the 2-D weights
(norms stay f32, as llama.cpp's own converter keeps them). For GGUF "llama" the q/k rows are
permuted from Hugging Face's half-split rotary layout to llama.cpp's interleaved one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dolmus.runtime.gguf_loader import hf_to_gguf_name
from dolmus.runtime.loader import iter_weights, safetensors_files

GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer, model_dir: Path, vocab_size: int) -> None:  # noqa: ANN001
    import sentencepiece as spm
    from gguf import TokenType

    path = model_dir / "tokenizer.model"
    if not path.is_file():
        raise ValueError(
            f"convert: {str(model_dir)!r} has no tokenizer.model (only SentencePiece is supported)"
        )
    sp = spm.SentencePieceProcessor(model_file=str(path))
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        if i >= sp.get_piece_size():
            tokens.append(f"[PAD{i}]".encode())
            scores.append(-1000.0)
            types.append(TokenType.UNUSED)
            continue
        tokens.append(sp.id_to_piece(i).encode())
        scores.append(sp.get_score(i))
        kinds = (
            (sp.is_unknown, TokenType.UNKNOWN),
            (sp.is_control, TokenType.CONTROL),
            (sp.is_byte, TokenType.BYTE),
            (sp.is_unused, TokenType.UNUSED),
        )
        types.append(next((t for test, t in kinds if test(i)), TokenType.NORMAL))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def convert_to_gguf(model_dir: str | Path, out: str | Path, tensor_type: str = "f16") -> Path:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    model_dir, out = Path(model_dir), Path(out)
    if tensor_type not in TYPES:
        raise ValueError(f"convert: type must be one of {', '.join(TYPES)}, got {tensor_type!r}")
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH.get((cfg.get("architectures") or [""])[0])
    if arch is None:
        raise ValueError(f"convert: architecture {cfg.get('architectures')} is not supported")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(
            f"convert: rope scaling ({rope.get('rope_type', rope.get('type'))}) is not written to GGUF yet"
        )
    writer = GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_vocab_size(cfg["vocab_size"])
    file_types = {
        "f32": LlamaFileType.ALL_F32,
        "f16": LlamaFileType.MOSTLY_F16,
        "bf16": LlamaFileType.MOSTLY_BF16,
        "q8_0": LlamaFileType.MOSTLY_Q8_0,
        "q4_0": LlamaFileType.MOSTLY_Q4_0,
        "q4_1": LlamaFileType.MOSTLY_Q4_1,
    }
    writer.add_file_type(file_types[tensor_type])
    _add_tokenizer(writer, model_dir, cfg["vocab_size"])

    qtypes = {
        "q8_0": GGMLQuantizationType.Q8_0,
        "q4_0": GGMLQuantizationType.Q4_0,
        "q4_1": GGMLQuantizationType.Q4_1,
    }
    for name, tensor in iter_weights(safetensors_files(model_dir)):
        t = tensor.float()
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = _permute(t, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = _permute(t, kv_heads)
        gguf_name = hf_to_gguf_name(name)
        kind = tensor_type
        if kind in qtypes and t.shape[-1] % GGML_QUANT_SIZES[qtypes[kind]][0]:
            kind = "f16"  # rows must split into whole blocks; llama.cpp's converter falls back the same way
        if t.dim() < 2 or kind == "f32":
            writer.add_tensor(gguf_name, t.numpy())
        elif kind == "f16":
            writer.add_tensor(gguf_name, t.to(torch.float16).numpy())
        elif kind == "bf16":
            data = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            writer.add_tensor(gguf_name, data, raw_dtype=GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(gguf_name, quantize(t.numpy(), qtypes[kind]), raw_dtype=qtypes[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
