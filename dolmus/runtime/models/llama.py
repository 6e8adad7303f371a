"""The Llama family: Llama 2/3 and Mistral here; Qwen2 and Qwen3 (qwen2.py, qwen3.py) run
on the same class, switched by `ModelConfig` (attention bias, q/k RMSNorm).

The model sees a flat batch of tokens with positions and attention metadata; it knows
nothing of requests. Parameter names mirror the Hugging Face checkpoints, except that
q/k/v and gate/up are fused into one matrix each (fewer, larger GEMMs). Under tensor
parallelism (`ParallelConfig`) each rank holds its share of the attention heads and of the
MLP's inner features: q/k/v and gate/up are column-parallel (KV heads shared by several
ranks when there are fewer of them than ranks), o and down row-parallel (their outputs
all-reduced); the embedding and LM head hold a share of the vocabulary (the embedding
all-reduced, the logits all-gathered), and norms are whole on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dolmus.config import ModelConfig, parse_common_fields
from dolmus.distributed.parallel_config import SINGLE_RANK, ParallelConfig, PartSlice
from dolmus.runtime.attention import AttentionBackend, AttentionMetadata
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.layers.embedding import VocabParallelEmbedding
from dolmus.runtime.layers.fused_moe import FusedExperts
from dolmus.runtime.layers.linear import Linear, ParallelStyle, load_plain
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.norm import RMSNorm
from dolmus.runtime.layers.ops import TORCH_OPS, LayerOps
from dolmus.runtime.layers.rotary import RotaryEmbedding
from dolmus.runtime.models.llama_decode import FusedDecoder, build_fused_decoder
from dolmus.runtime.models.registry import register_architecture

CosSin = tuple[torch.Tensor, torch.Tensor]

# checkpoint sub-name -> (our fused sub-name, shard)
STACKED_PARAMS = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", "gate"),
    ("up_proj", "gate_up_proj", "up"),
)


def fused_name(name: str) -> tuple[str, str | None]:
    """A checkpoint tensor's parameter and shard: q/k/v into qkv_proj, gate/up into gate_up_proj."""
    for ckpt_part, ours, shard_id in STACKED_PARAMS:
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{ours}."), shard_id
    return name, None


def expected_weights(model: nn.Module) -> set[tuple[str, str | None]]:
    """(parameter, shard) pairs a checkpoint must fill: one per shard of a fused linear layer."""
    expected: set[tuple[str, str | None]] = {
        (name, None) for name, _ in model.named_parameters(remove_duplicate=False)
    }
    for name, param in model.named_parameters(remove_duplicate=False):
        shards = getattr(param, "expected_shards", None)  # filled piece by piece (experts)
        if shards is not None:
            expected.discard((name, None))
            expected.update((name, shard) for shard in shards)
    for prefix, module in model.named_modules():
        if isinstance(module, Linear):
            for pname, _ in module.named_parameters(recurse=False):
                full = f"{prefix}.{pname}"
                expected.discard((full, None))
                expected.update((full, shard) for shard in module.shard_offsets)
    return expected


def process_loaded_weights(model: nn.Module) -> None:
    """Let every layer that stores its weights its own way (linear layers, experts) do so once
    all are loaded: pack, quantize, place pre-quantized codes."""
    for module in model.modules():
        if isinstance(module, (Linear, FusedExperts)):
            module.process_weights_after_loading()


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        parallel: ParallelConfig,
        ops: LayerOps,
        window: int | None = None,
    ) -> None:
        """`window`: this layer's sliding attention window (None: the whole context)."""
        super().__init__()
        self.ops = ops
        self.window = window
        self.num_heads = parallel.split(cfg.num_heads, "num_attention_heads")[1]
        first_kv, self.num_kv_heads = parallel.kv_heads(cfg.num_kv_heads)
        self.head_dim = d = cfg.head_dim
        q_size = cfg.num_heads * d
        kv_part = PartSlice(cfg.num_kv_heads * d, first_kv * d, self.num_kv_heads * d)  # maybe shared
        self.qk_size = (self.num_heads + self.num_kv_heads) * d  # this rank's q and k
        self.qkv_proj = Linear(
            cfg.hidden_size,
            {"q": q_size, "k": kv_part, "v": kv_part},
            cfg.attention_bias,
            dtype,
            method,
            style=ParallelStyle.COLUMN,
            parallel=parallel,
        )
        self.o_proj = Linear(
            q_size, cfg.hidden_size, False, dtype, method, style=ParallelStyle.ROW, parallel=parallel
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.scale = cfg.attention_scale or cfg.head_dim**-0.5
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: CosSin,
        kv_cache: PagedKV,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rows`: the only rows of the output the caller reads (every row's key and value still
        go to the cache); the o-projection runs for them alone."""
        qkv = self.qkv_proj(x)
        num_tokens = qkv.shape[0]
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.qk_size].view(num_tokens, heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # q and k rotate together: one set of elementwise ops instead of two (or one C call).
        qk = self.ops.rotary(qk, cos_sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.window)
        if rows is None:
            return self.o_proj(out)
        return self.o_proj(out.index_select(0, rows)) if len(rows) else x[:0]


class MLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        parallel: ParallelConfig,
        ops: LayerOps,
        reduce_output: bool = True,
    ) -> None:
        """`reduce_output=False`: under tensor parallelism the output is this rank's partial sum
        (the caller all-reduces it with others)."""
        super().__init__()
        self.ops = ops
        size = cfg.intermediate_size
        column, row = ParallelStyle.COLUMN, ParallelStyle.ROW
        self.gate_up_proj = Linear(
            cfg.hidden_size,
            {"gate": size, "up": size},
            False,
            dtype,
            method,
            style=column,
            parallel=parallel,
            gated=True,
        )
        self.down_proj = Linear(
            size,
            cfg.hidden_size,
            False,
            dtype,
            method,
            style=row,
            parallel=parallel,
            reduce_output=reduce_output,
        )
        self.size = self.gate_up_proj.out_features // 2  # this rank's share of the inner features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x, self.ops.silu_and_mul))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        parallel: ParallelConfig,
        ops: LayerOps,
        mlp: nn.Module | None = None,
        window: int | None = None,
        attention: nn.Module | None = None,
    ) -> None:
        """`mlp`: the feed-forward block when it is not the dense one (a Mixture-of-Experts);
        `window`: the layer's sliding attention window; `attention`: the attention block when it
        is not this file's (DeepSeek's MLA), called as attention(x, cos_sin, kv_cache, meta, rows)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        if attention is None:
            attention = Attention(cfg, dtype, method, backend, parallel, ops, window)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.mlp = mlp if mlp is not None else MLP(cfg, dtype, method, parallel, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: CosSin,
        kv_cache: PagedKV,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings for the first layer, residual None);
        residual: the stream before it. Returns this layer's MLP output and the stream before it:
        each residual add is done in place by the norm that follows it (one pass, as vLLM's
        fused_add_rms_norm), with the bits of `x + residual` then the norm. `rows`: only these
        rows come out (the last layer's, where only the sampled rows are read)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.forward_add(x, residual)
        h = self.self_attn(h, cos_sin, kv_cache, meta, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
            if not len(rows):  # no row read: the layer's keys and values were all it had to give
                return h, residual
        h = self.post_attention_layernorm.forward_add(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        max_len: int,
        parallel: ParallelConfig,
        ops: LayerOps,
        make_mlp: Callable[[int], nn.Module | None] | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg,
                dtype,
                method,
                backend,
                parallel,
                ops,
                make_mlp(i) if make_mlp else None,
                cfg.window_of(i),
            )
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        max_len: int,
        parallel: ParallelConfig = SINGLE_RANK,
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        make_mlp = self.mlp_factory(cfg, dtype, method, parallel, ops)
        self.model = self.build_model(cfg, dtype, method, backend, max_len, parallel, ops, make_mlp)
        # A tied head is still its own Linear (sharing the embedding's storage, the same rows
        # of the vocabulary under tensor parallelism) so its method may pack or quantize it.
        self.lm_head = Linear(
            cfg.hidden_size,
            parallel.vocab(cfg.vocab_size),
            False,
            dtype,
            method.head_method(),
            style=ParallelStyle.COLUMN,
            parallel=parallel,
            gather_output=True,
        )
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.weight_shared = True
        # Speculative heads (EAGLE-3) read the residual stream entering these layers: each
        # forward leaves it in `captured`, [tokens, len(capture_layers) * hidden], in this order.
        self.capture_layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[PagedKV],
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states of every token, or with `rows` of those rows alone, in that
        order: the last layer then runs its o-projection and MLP for them only (a prompt chunk
        samples from its last row at most; llama.cpp skips the same work). Every token's key and
        value are cached either way."""
        x = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        cos_sin = self.model.rotary.lookup(positions)
        captured = []
        last = len(self.model.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches)):
            if i in self.capture_layers:  # the stream entering layer i (layers add to it in place)
                captured.append(x.clone() if residual is None else x + residual)
            x, residual = layer(x, residual, cos_sin, cache, meta, rows if i == last else None)
        if self.capture_layers:
            order = sorted(set(self.capture_layers))
            self.captured = torch.cat([captured[order.index(i)] for i in self.capture_layers], dim=-1)
        return self.model.norm(x) if residual is None else self.model.norm.forward_add(x, residual)

    def build_model(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        max_len: int,
        parallel: ParallelConfig,
        ops: LayerOps,
        make_mlp: Callable[[int], nn.Module | None] | None,
    ) -> nn.Module:
        """The decoder stack (embedding, `rotary` with `lookup(positions)`, `layers`, `norm`); a
        family with other attention overrides this."""
        return LlamaModel(cfg, dtype, method, backend, max_len, parallel, ops, make_mlp)

    def mlp_factory(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        parallel: ParallelConfig,
        ops: LayerOps,
    ) -> Callable[[int], nn.Module | None] | None:
        """What builds layer i's feed-forward block (None from it: the dense MLP); None: the
        dense MLP everywhere (a family with experts overrides this)."""
        return None

    def route_weight(self, name: str) -> tuple[str, str | None]:
        """A checkpoint tensor's parameter and shard (a family with other names overrides this)."""
        return fused_name(name)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def fused_decoder(self, kv_caches: list[PagedKV], max_rows: int) -> tuple[FusedDecoder | None, str]:
        """The decode step as one native call (llama_decode.py), or None and why not."""
        return build_fused_decoder(self, kv_caches, max_rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into place; raise naming any weight left unloaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = expected_weights(self)
        tied = self.cfg.tie_word_embeddings
        if tied:
            expected.discard(("lm_head.weight", None))
        loaded: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if tied and name == "lm_head.weight":
                if not isinstance(tensor, torch.Tensor):  # the embedding's codes (GGUF): the head's
                    self.lm_head.weight_loader(self.lm_head.weight, tensor)
                continue
            name, shard = self.route_weight(name)
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} matches no parameter of {self.cfg.architecture}"
                )
            getattr(param, "weight_loader", load_plain)(param, tensor, shard)
            loaded.add((name, shard))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint lacks {len(missing)} weights: {shown}")

    def process_weights_after_loading(self) -> None:
        process_loaded_weights(self)


# Mistral's config differs from Llama's only in a sliding window (every layer's), which the
# shared fields read.
# llama.cpp stores both with the q/k rotary halves interleaved.
def parse_llama(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Llama has no sliding window (transformers ignores one in its config)."""
    return {**parse_common_fields(raw, source), "sliding_window": None, "sliding_layers": None}


register_architecture(
    "LlamaForCausalLM",
    parse=parse_llama,
    model_cls=LlamaForCausalLM,
    gguf_type="llama",
    gguf_interleaved_qk=True,
)
register_architecture(
    "MistralForCausalLM",
    parse=parse_common_fields,
    model_cls=LlamaForCausalLM,
    gguf_type="mistral",
    gguf_interleaved_qk=True,
)
