"""llama.cpp GGUF files as a model source: config, tokenizer and weights.

transformers reads the architecture and the tokenizer from the file's metadata; the gguf
package reads the tensors. Linear weights in the block types of quant/gguf_unpack.py (Q4_0,
Q4_1, Q8_0, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K) keep their blocks (`BlockCodes`) and run
as stored where our kernels run (prequantized.py decides); where a tied embedding is in one
of those types, the LM head gets its blocks too. Every other type the package knows (F16,
BF16, the IQ types, ...) is dequantized to float on load (add --quantization to requantize
those for our kernels). The file's type maps to a
registered architecture (runtime/models/registry.py); names map back to Hugging Face's,
and where the architecture says llama.cpp interleaves the q/k rotary halves (Llama,
Mistral, Mixtral) those rows are permuted back to Hugging Face's halves; a family may rename
some per-layer tensors (Gemma 3's four norms) and store its norms with an offset (Gemma's 1 + w).

Mixture-of-Experts files (`{arch}.expert_count` set: "llama" as Mixtral, "qwen2moe",
"qwen3moe") keep each layer's experts in three stacked tensors, `ffn_{gate,up,down}_exps`
[experts, rows, inputs]; they are split into each expert's matrix under Hugging Face's
names (blocks stay blocks), beside the router `ffn_gate_inp` and Qwen2-MoE's shared expert
(`ffn_*_shexp`) and its gate (`ffn_gate_inp_shexp`, a vector in the file).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dolmus.quant.gguf_blocks import BlockCodes
from dolmus.quant.gguf_unpack import GGUF_BLOCK_TYPES, from_gguf_blocks
from dolmus.runtime.models import registry

logger = logging.getLogger(__name__)

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture-of-Experts layers: the router, Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# the experts, stacked [experts, rows, inputs] in one tensor each: per expert, its matrix
EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LEGACY_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# transformers' model_type for a GGUF `general.architecture` it renames on reading
_RENAMED_BY_TRANSFORMERS = {"gemma3_text": "gemma3"}
_IGNORED = ("rope_freqs.weight",)  # recomputed from the config
_LINEAR_WEIGHTS = ("_proj.weight", "lm_head.weight")


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    return p.suffix == ".gguf" and p.is_file()


def gguf_config(path: Path) -> dict[str, Any]:
    """The file's metadata as a Hugging Face config dict, naming the registered architecture
    the file's type stands for; `ModelConfig.from_dict` then parses it as any config.json."""
    from transformers import AutoConfig

    try:
        with _shared_reader(path, config_only=True):
            raw = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    except Exception as exc:  # transformers raises several kinds for unknown or broken files
        raise ValueError(f"model: cannot read GGUF metadata from {str(path)!r} ({exc})") from exc
    experts = _metadata_int(path, "expert_count") or 0
    # A file with experts is read by its own type: transformers knows no Mixtral in "llama"
    # files and renames llama.cpp's "qwen2moe"/"qwen3moe"; without, by transformers' (which
    # tells a Mistral "llama" file by its name).
    model_type = raw.get("model_type")
    gguf_type = _file_type(path) if experts else _RENAMED_BY_TRANSFORMERS.get(model_type, model_type)
    raw["architectures"] = [registry.architecture_for_gguf(gguf_type, experts > 0).name]
    if experts:
        raw.update(_expert_fields(path, experts))
    # transformers does not carry the explicit head size over for every architecture (Qwen3
    # falls back to its default of 128): take it from the file.
    head_dim = _metadata_int(path, "attention.key_length")
    if head_dim:
        raw["head_dim"] = head_dim
    raw["torch_dtype"] = _file_dtype(path)
    return raw


def _file_dtype(path: Path) -> str:
    """The dtype the file's weights call for, as config.json would name it: float32 for a file
    of F32 tensors only; bfloat16 for F16, BF16 and the quantized types (their scales are fp16,
    and our kernels for them take bf16 activations where the CPU has bf16: see
    `EngineConfig.resolve_dtype`)."""
    from gguf import GGMLQuantizationType

    types = {t.tensor_type for t in _reader(path).tensors}
    return "float32" if types <= {GGMLQuantizationType.F32} else "bfloat16"


def _reader(path: Path) -> Any:
    """The file's GGUFReader, parsed once per process for every read of ours.

    Parsing is the slow part of opening a GGUF (the reader walks every metadata field in
    Python: ~50k tokenizer strings in a small chat model); the tensors themselves stay
    memory-mapped, so holding the reader costs no copy of the weights.
    """
    stat = path.stat()
    return _cached_reader(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _cached_reader(path: str, mtime_ns: int, size: int) -> Any:
    from gguf.gguf_reader import GGUFReader  # the class itself, never the stand-in below

    class PlainViewReader(GGUFReader):
        """The reader over a plain ndarray view of its memory map: np.memmap runs Python code
        (__array_finalize__, __getitem__) for each of the ~10^5 small views the parser
        takes; a plain view of the same mapping (no copy: it keeps the map as its base)
        does not."""

        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = np.asarray(value)

    return PlainViewReader(path)


class _ConfigFields:
    """Our reader as transformers' config parsing sees it: without the tokenizer's arrays.

    transformers converts every metadata value to Python while it reads a config, the
    ~150k strings and ids of a chat model's vocabulary and merges included (seconds), only
    to take a handful of numbers. It counts the vocabulary only when the file gives no
    `{arch}.vocab_size`; then the arrays stay."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        arch_field = reader.get_field("general.architecture")
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field is not None else ""
        keep_all = f"{arch}.vocab_size" not in reader.fields
        self.fields = {
            k: f
            for k, f in reader.fields.items()
            if keep_all or not (k.startswith("tokenizer.") and len(f.data) > 1)
        }

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


@contextlib.contextmanager
def _shared_reader(path: Path, config_only: bool = False) -> Iterator[None]:
    """transformers opens the file with its own GGUFReader for the config and again for the
    tokenizer (`from gguf import GGUFReader` at call time); for the duration, hand it ours
    for this file, so the metadata is parsed once in all (`config_only`: as `_ConfigFields`).
    Other files get a fresh reader."""
    import gguf

    original = gguf.GGUFReader
    ours = str(path.resolve())

    def reader(p: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and str(Path(p).resolve()) == ours:
            return _ConfigFields(_reader(path)) if config_only else _reader(path)
        return original(p, *args, **kwargs)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _file_type(path: Path) -> str | None:
    field = _reader(path).get_field("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else None


def _metadata_int(path: Path, key: str) -> int | None:
    arch = _file_type(path)
    field = _reader(path).get_field(f"{arch}.{key}") if arch is not None else None
    return int(field.parts[field.data[0]][0]) if field is not None else None


def _expert_fields(path: Path, experts: int) -> dict[str, Any]:
    """The Mixture-of-Experts config fields of llama.cpp's keys, under both families' names
    (each family's parser reads its own)."""
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_local_experts": experts,
        "num_experts_per_tok": _metadata_int(path, "expert_used_count") or 0,
    }
    keys = {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    }
    for key, name in keys.items():
        value = _metadata_int(path, key)
        if value:
            fields[name] = value
    # llama.cpp renormalizes the top-k weights per architecture (Qwen3-MoE yes, Qwen2-MoE no:
    # transformers' defaults say the same), unless the file says otherwise
    norm = _metadata_int(path, "expert_weights_norm")
    if norm is not None:
        fields["norm_topk_prob"] = bool(norm)
    return fields


def gguf_tokenizer(path: Path) -> Any:
    """The file's tokenizer, as transformers builds it from the metadata.

    Building it converts the vocabulary and merges in Python (~2 s for a 49k-token chat
    model), so the result is saved once per file (keyed by path, size and modification time)
    under `$XDG_CACHE_HOME/dolmus/gguf-tokenizers` and loaded from there next time (~0.2 s),
    encoding as the one built from the file did.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cached = _tokenizer_cache_dir(path)
    if cached is not None and cached.is_dir():
        try:
            # The saved pipeline exactly: a class such as Qwen2Tokenizer would put its own
            # pre-tokenizer over the one converted from the file's vocabulary type.
            return PreTrainedTokenizerFast.from_pretrained(str(cached), local_files_only=True)
        except Exception as exc:  # a damaged entry: build afresh
            logger.warning("GGUF tokenizer cache %s unreadable (%s); rebuilding it", cached, exc)
    with _shared_reader(path):
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=cached.parent)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(cached, ignore_errors=True)
            os.replace(tmp, cached)  # whole or absent, for concurrent loaders
        except OSError as exc:
            logger.info("GGUF tokenizer not cached (%s)", exc)
    return tokenizer


def _tokenizer_cache_dir(path: Path) -> Path | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    return Path(root) / "dolmus" / "gguf-tokenizers" / key


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(
    path: Path, architecture: str, num_heads: int, num_kv_heads: int, progress: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    reader = _reader(path)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(reader.tensors), desc="Loading GGUF", unit="tensor", leave=False)
    quantized: set[str] = set()
    kept: set[str] = set()
    arch = registry.architecture(architecture)
    permuted = arch.gguf_interleaved_qk
    per_layer = {**_PER_LAYER, **dict(arch.gguf_layer_names)}
    tied_head = "output.weight" not in {t.name for t in reader.tensors}
    for t in reader.tensors:
        if bar is not None:
            bar.update(1)
        if t.name in _IGNORED:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        stack = _expert_stack(t.name)
        if stack is not None:
            yield from _experts(t, stack, shape, kept, quantized)
            continue
        name = _hf_name(t.name, per_layer)
        type_name = t.tensor_type.name
        blocks = type_name in GGUF_BLOCK_TYPES and len(shape) == 2
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            tensor: torch.Tensor | BlockCodes = torch.from_numpy(t.data.reshape(shape).copy())
        elif blocks and name.endswith(_LINEAR_WEIGHTS):
            kept.add(type_name)
            tensor = from_gguf_blocks(type_name, t.data, shape)
        else:
            quantized.add(type_name)
            array = gguf.quants.dequantize(t.data, t.tensor_type)
            tensor = torch.from_numpy(array.reshape(shape).copy())
        if name.endswith("shared_expert_gate.weight") and isinstance(tensor, torch.Tensor):
            tensor = tensor.reshape(1, -1)  # llama.cpp keeps it as a vector
        if arch.gguf_norm_offset and name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
            tensor = tensor - arch.gguf_norm_offset  # stored as offset + w (Gemma's 1 + w)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if "q_proj" in name else num_kv_heads
            if isinstance(tensor, BlockCodes):  # rows move with their scales
                tensor = tensor.rows(_unpermute(torch.arange(shape[0]), heads))
            else:
                tensor = _unpermute(tensor, heads)
        yield name, tensor
        if tied_head and blocks and name == "model.embed_tokens.weight":
            # The head multiplies by the embedding: let it read the file's blocks, not floats.
            kept.add(type_name)
            yield "lm_head.weight", from_gguf_blocks(type_name, t.data, shape)
    if bar is not None:
        bar.close()
    if quantized:
        logger.info("GGUF: dequantized %s tensors to float on load", ", ".join(sorted(quantized)))
    if kept:
        logger.info(
            "GGUF: %s linear weights keep their blocks (our kernels where they run)", ", ".join(sorted(kept))
        )


def _expert_stack(gguf_name: str) -> tuple[int, str] | None:
    """(layer, projection) of a stacked experts tensor's name, or None for any other tensor."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERT_STACKS and parts[3] == "weight":
        return int(parts[1]), EXPERT_STACKS[parts[2]]
    return None


def _experts(
    t: Any, stack: tuple[int, str], shape: tuple[int, ...], kept: set[str], dequantized: set[str]
) -> Iterator[tuple[str, torch.Tensor | BlockCodes]]:
    """One stacked experts tensor [experts, rows, inputs] as each expert's matrix, under the
    Hugging Face name of a Qwen-style checkpoint (which the MoE models route for Mixtral too).
    Blocks of quant/gguf_unpack.py's types stay blocks (run as stored where our kernels run:
    prequantized.py); other quantized types are decoded to float."""
    import gguf

    if len(shape) != 3:
        raise ValueError(
            f"model: GGUF experts tensor {t.name!r} has shape {shape}, not [experts, rows, inputs]"
        )
    experts, rows, inputs = shape
    type_name = t.tensor_type.name
    stacked: torch.Tensor | BlockCodes
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        stacked = torch.from_numpy(t.data.reshape(shape).copy())
    elif type_name in GGUF_BLOCK_TYPES:
        kept.add(type_name)
        stacked = from_gguf_blocks(type_name, t.data, (experts * rows, inputs))
    else:
        dequantized.add(type_name)
        stacked = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).copy())
    layer, proj = stack
    for expert in range(experts):
        name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
        if isinstance(stacked, BlockCodes):
            yield name, stacked.narrow(0, expert * rows, rows)
        else:
            yield name, stacked[expert]


def hf_to_gguf_name(name: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name (the inverse of the loading map; an
    expert's matrices go into stacked tensors, `EXPERT_STACKS`, and have none of their own)."""
    name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # Mixtral's router
    for gguf_name, hf in _GLOBAL.items():
        if name == hf:
            return gguf_name
    parts = name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"]:
        inner = ".".join(parts[3:-1])
        for gguf_part, hf_part in _PER_LAYER.items():
            if inner == hf_part:
                return f"blk.{parts[2]}.{gguf_part}.{parts[-1]}"
    raise ValueError(f"convert: tensor {name!r} has no GGUF name here")


def _hf_name(name: str, per_layer: dict[str, str]) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in per_layer:
        return f"model.layers.{parts[1]}.{per_layer[parts[2]]}.{parts[3]}"
    if len(parts) == 5 and parts[0] == "blk" and parts[2] in _LEGACY_EXPERT and parts[3].isdigit():
        # llama.cpp's first Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{_LEGACY_EXPERT[parts[2]]}.{parts[4]}"
    raise ValueError(f"model: GGUF tensor {name!r} has no Hugging Face counterpart here")
