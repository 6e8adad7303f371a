"""Builds a model and fills it from a Hugging Face folder's safetensors files."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dolmus.config import ModelConfig
from dolmus.distributed.parallel_config import SINGLE_RANK, ParallelConfig
from dolmus.quant.checkpoint import checkpoint_format, unpack_stream
from dolmus.quant.prequantized import PrequantizedMethod
from dolmus.runtime.attention import AttentionBackend
from dolmus.runtime.gguf_loader import is_gguf, iter_gguf_weights
from dolmus.runtime.layers.linear import Linear, module_bytes
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.ops import TORCH_OPS, LayerOps
from dolmus.runtime.models.registry import model_class

logger = logging.getLogger(__name__)


def safetensors_files(folder: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, else every *.safetensors file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"model: {index.name} names missing files: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {str(folder)!r} holds no *.safetensors weights")
    return files


def iter_weights(
    files: list[Path], progress: bool = False, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files, by name; `keep`: only those it accepts are read (a rank skips
    other ranks' experts under expert parallelism)."""
    bar = None
    if progress:
        from tqdm import tqdm

        total = 0
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                total += len(list(handle.keys()))
        bar = tqdm(total=total, desc="Loading weights", unit="tensor", leave=False)
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                if keep is None or keep(name):
                    yield name, handle.get_tensor(name)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()


def _log_checkpoint_layers(source: str, model: nn.Module) -> None:
    """How many linear layers run their checkpoint codes as stored, and how many were dequantized."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, Linear) and m.checkpoint_layout:
            counts[m.checkpoint_layout] = counts.get(m.checkpoint_layout, 0) + 1
    if not counts:
        return
    logger.info(
        "%s checkpoint: linear layers %s%s",
        source,
        ", ".join(f"{layout}: {count}" for layout, count in sorted(counts.items())),
        " (no kernel takes their codes here: see dolmus/quant/prequantized.py)"
        if counts.get("dequantized")
        else "",
    )


def load_model(
    folder: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    method: LinearMethod,
    backend: AttentionBackend,
    max_len: int,
    progress: bool = False,
    parallel: ParallelConfig = SINGLE_RANK,
    ops: LayerOps = TORCH_OPS,
    int8_block_activations: bool = False,
) -> nn.Module:
    """Build the architecture's model for this tensor-parallel rank and fill it from `folder`.
    `int8_block_activations`: GGUF blocks on the AVX2 kernels round x to int8 (gguf_blocks.matmul)."""
    gguf = is_gguf(folder)
    fmt = checkpoint_format(cfg.quantization_config)
    if gguf or fmt is not None:  # 4-bit codes may arrive as stored (GGUF Q4_0, GPTQ, AWQ)
        method = PrequantizedMethod(method, int8_block_activations)
    with torch.device(device):
        model = model_class(cfg.architecture)(cfg, dtype, method, backend, max_len, parallel, ops)
    if gguf:
        weights = iter_gguf_weights(folder, cfg.architecture, cfg.num_heads, cfg.num_kv_heads, progress)
    else:
        weights = iter_weights(safetensors_files(folder), progress, getattr(model, "keeps_weight", None))
    if fmt is not None:
        weights = unpack_stream(fmt, weights)
    model.load_weights(weights)
    model.process_weights_after_loading()
    model.eval()
    if fmt is not None or gguf:
        _log_checkpoint_layers("GGUF" if gguf else fmt["method"].upper(), model)
    size = module_bytes(model)
    logger.info("loaded %s from %s: %.1f MB of weights in %s", cfg.architecture, folder, size / 1e6, dtype)
    return model
