"""`dolmus convert --to gguf`: write a Hugging Face folder as a llama.cpp GGUF file.

Llama, Mistral (both as GGUF "llama"), Qwen2 and Qwen3, and the Mixture-of-Experts Mixtral (as
"llama" with experts, as llama.cpp writes it), Qwen2-MoE and Qwen3-MoE, with a SentencePiece
tokenizer (tokenizer.model). Tensor types: f32, f16, bf16, or q8_0 / q4_0 / q4_1 for the 2-D
weights and the stacked experts (norms and MoE routers stay f32, as llama.cpp's own converter
and quantizer keep them). For GGUF "llama" the q/k rows are permuted from Hugging Face's
half-split rotary layout to llama.cpp's interleaved one. Each MoE layer's experts are written
as llama.cpp's three stacked tensors (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`:
[experts, rows, inputs]).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from dolmus.runtime.gguf_loader import EXPERT_STACKS, hf_to_gguf_name
from dolmus.runtime.loader import iter_weights, safetensors_files

GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
# one expert's matrix in a Hugging Face checkpoint: (layer, expert, projection)
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACK_NAME = {proj: stack for stack, proj in EXPERT_STACKS.items()}
_KEEP_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # routers: never quantized
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
    experts = _add_expert_fields(writer, cfg)
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
    pending: dict[tuple[int, str], dict[int, torch.Tensor]] = {}  # an MoE layer's experts so far
    for name, tensor in iter_weights(safetensors_files(model_dir)):
        t = tensor.float()
        expert = _EXPERT.match(name)
        if expert is not None:
            layer, index, proj = int(expert.group(1)), int(expert.group(2)), expert.group(3)
            key = (layer, _PROJ.get(proj, proj))
            pending.setdefault(key, {})[index] = t
            if len(pending[key]) < experts:
                continue
            stacked = pending.pop(key)
            t = torch.stack([stacked[e] for e in range(experts)])
            gguf_name = f"blk.{layer}.{_STACK_NAME[key[1]]}.weight"
        else:
            if arch == "llama" and name.endswith("q_proj.weight"):
                t = _permute(t, heads)
            elif arch == "llama" and name.endswith("k_proj.weight"):
                t = _permute(t, kv_heads)
            gguf_name = hf_to_gguf_name(name)
            if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
                t = t.reshape(-1)  # llama.cpp's shared-expert gate is a vector
        kind = "f32" if gguf_name.endswith(_KEEP_F32) else tensor_type
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
    if pending:
        raise ValueError(
            f"convert: experts missing from the checkpoint for (layer, matrix) {sorted(pending)}"
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_expert_fields(writer, cfg: dict) -> int:  # noqa: ANN001
    """llama.cpp's Mixture-of-Experts keys; the number of experts (0: a dense model)."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not experts:
        return 0
    step = int(cfg.get("decoder_sparse_step") or 1)
    if cfg.get("mlp_only_layers") or step > 1:
        # llama.cpp's Qwen MoE graphs have experts in every layer
        raise ValueError(
            "convert: MoE models with dense layers (mlp_only_layers, decoder_sparse_step) have no GGUF form"
        )
    writer.add_expert_count(experts)
    writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if cfg.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
    if "norm_topk_prob" in cfg:  # Qwen: whether the top-k weights are renormalized
        writer.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    return experts
