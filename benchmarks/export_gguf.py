"""Export a Llama-architecture Hugging Face folder with a SentencePiece tokenizer to GGUF.

Enough of llama.cpp's converter for the peer benchmarks: the same weights served by a
llama.cpp-based server (llama-cpp-python from PyPI) and by dolmus. q/k projections are
permuted back from Hugging Face's half-split rotary layout to llama.cpp's interleaved one.

    python benchmarks/export_gguf.py dolmus/default_model /tmp/stories260k.gguf
    python benchmarks/export_gguf.py MODEL_DIR out.gguf --dtype bf16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from safetensors.torch import load_file


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(writer: GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        tokens.append(sp.id_to_piece(i).encode())
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(TokenType.BYTE)
        elif sp.is_unused(i):
            types.append(TokenType.UNUSED)
        else:
            types.append(TokenType.NORMAL)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def export(model_dir: Path, out: Path, dtype: str = "f32") -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg["architectures"][0] != "LlamaForCausalLM":
        raise SystemExit("only LlamaForCausalLM folders are exported")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = GGUFWriter(str(out), "llama")
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
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(0 if dtype == "f32" else 32)  # ALL_F32 / MOSTLY_BF16
    _tokenizer(writer, model_dir, cfg["vocab_size"])

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf_name, tensor in weights.items():
        if hf_name not in names:
            raise SystemExit(f"unexpected tensor {hf_name}")
        t = tensor.float()
        if hf_name.endswith("q_proj.weight"):
            t = _permute(t, heads)
        elif hf_name.endswith("k_proj.weight"):
            t = _permute(t, kv_heads)
        if dtype == "bf16" and t.dim() == 2:  # norms stay f32, as llama.cpp's converter keeps them
            data = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            writer.add_tensor(names[hf_name], data, raw_dtype=GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(names[hf_name], t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    args = parser.parse_args()
    export(args.model_dir, args.out, args.dtype)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
