"""The Llama family's step as one call into C (runtime/native/decode_step.c).

A step in which every sequence has one new token (decodes, and a decode's drafts) runs from the
token ids to the final norm in one native call: the very kernels the modules call, in the
same order with the same rounding, without the Python calls and PyTorch ops between them,
which at one sequence of a small model cost as much as reading its weights. A step with prompt
chunks runs there too where the prefill kernel takes every layer (no sliding window, its head
sizes) and each linear layer's kernel takes the step's rows: a 128-token prompt of a 0.5B body
takes ~2% less time there (the KV writes through `index_copy_` alone were ~1%), a 16-token one
~11% less. It is built only where every part of the model already runs on a kernel of ours (the
native attention backend over a plain cache, one tensor-parallel rank, and either bf16 on
AVX-512 BF16 with every linear layer on our AMX, int4, int8 or grouped int8 kernel
(decode_step.c), or float32 on AVX2 with every linear layer on bf16 weights or GGUF blocks
(decode_step_f32.c)); elsewhere, and for every other step, the modules run. The CPU's
counterpart of the CUDA graphs other engines capture for decode steps.
"""

from __future__ import annotations

import ctypes
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dolmus.runtime import native
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.attention.native_cpu import prefill_kernel_takes
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.linear_method import BF16_KINDS, F32_KINDS, NativeKind, NativeLinear
from dolmus.runtime.native import decode_step

if TYPE_CHECKING:
    from dolmus.runtime.block_table import BlockTable
    from dolmus.runtime.models.llama import LlamaForCausalLM


@dataclass
class FusedDecoder:
    """A model's step in C: decode steps of up to `max_rows` sequences, and steps with prompt
    chunks of up to `prompt_rows` rows (0: none)."""

    desc: decode_step.DecoderDesc
    max_rows: int
    hidden: int
    dtype: torch.dtype  # bf16: decode_step.c; float32: decode_step_f32.c
    keep: list[object] = field(default_factory=list)  # what the descriptors point into
    prompt_rows: int = 0
    scratch_cols: dict[str, int] = field(default_factory=dict)  # each scratch buffer's row width
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)  # the buffers, rows >= max_rows
    one_region_steps: int = 0  # decode steps run as one parallel region (decode_step.c's team_step)
    vocab: int = 0  # the LM head's outputs where decode steps compute the logits too (attach_head)
    # of the last decode step, where it computed them: its logits [n, vocab] (a buffer the next
    # step writes again) and each row's largest logit's index (the first on ties)
    logits: torch.Tensor | None = None
    argmax: list[int] | None = None

    def __post_init__(self) -> None:
        # resolved once: a decode step runs on caches its weights just flushed, where every
        # Python, numpy or torch call costs tens of microseconds (docs/performance.md)
        self._step = decode_step.decode_step_fn(self.dtype)
        self._desc_address = ctypes.addressof(self.desc)
        self._out = torch.empty(self.max_rows, self.hidden, dtype=self.dtype)
        self._out_address = self._out.data_ptr()
        self._out_rows: dict[int, torch.Tensor] = {}  # n -> the first n rows of _out
        self._logits = torch.empty(0, 0, dtype=self.dtype)  # grown, with _argmax, to the most rows seen
        self._logits_address = 0
        self._logits_rows: dict[int, torch.Tensor] = {}
        self._argmax = array("q")

    def attach_head(self, model: LlamaForCausalLM) -> str:
        """Let decode steps compute the logits too, in the same call (the target model's; a
        draft model's runner calls its own LM head): what the step saves is the Python and
        PyTorch calls of an LM head module and of a greedy row's max, each paying for the caches
        the step's weights flushed. Returns why not, or ""."""
        from dolmus.runtime.models.llama import LlamaForCausalLM

        if type(model).compute_logits is not LlamaForCausalLM.compute_logits:
            return "the model's logits are more than its LM head's product"
        head = _native(model.lm_head)
        if head is None or head.kind not in (BF16_KINDS if self.dtype == torch.bfloat16 else F32_KINDS):
            return "the LM head runs on a product the step does not call"
        self.desc.head = decode_step.linear_desc(head)
        self.keep.append(head)
        self.vocab = head.n
        return ""

    def run(
        self, tokens: list[int], positions: list[int], seats: list[int], table: BlockTable
    ) -> torch.Tensor:
        """The final norm's output [n, hidden] for one new token per sequence: its token, its
        position, and its seat (row) in the runner's block table. The rows are a buffer the next
        decode step writes again: use them before it."""
        n = len(tokens)
        if not 0 < n <= self.max_rows:
            raise ValueError(f"a fused decode step takes 1 to {self.max_rows} sequences, not {n}")
        rows = array("q", tokens)
        rows.extend(positions)
        rows.extend(seats)
        logits = argmax = 0
        if self.vocab:
            if n > len(self._argmax):  # both buffers hold that many rows
                self._logits = torch.empty(n, self.vocab, dtype=self.dtype)
                self._logits_address = self._logits.data_ptr()
                self._logits_rows.clear()
                self._argmax = array("q", bytes(8 * n))
            logits, argmax = self._logits_address, self._argmax.buffer_info()[0]
        address = rows.buffer_info()[0]
        ran = self._step(
            self._desc_address, n, address, table.address, table.width, self._out_address, logits, argmax
        )
        if ran < 0:
            raise MemoryError("the fused decode step could not allocate its rows' block ids")
        self.one_region_steps += ran
        if self.vocab:
            self.logits = _first_rows(self._logits, self._logits_rows, n)
            self.argmax = self._argmax[:n].tolist()
        return _first_rows(self._out, self._out_rows, n)

    def run_step(
        self,
        cols: torch.Tensor,
        table: torch.Tensor,
        num_decodes: int,
        lengths: torch.Tensor,
        chunks: torch.Tensor,
        keep: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The final norm's output [rows or len(keep), hidden] of a step with prompt chunks, or
        None where the prefill kernel ran out of memory (the caller runs the modules; the keys
        and values written are the ones they write). All int64 and contiguous: cols [3, rows]
        (tokens, positions, slots), the decodes' rows first; table [entries, nb], a block row per
        decode, then per chunk; lengths [num_decodes] (position + 1); chunks [3, chunks] (first
        row, tokens, positions cached before); keep: the only rows the last layer carries on,
        ascending (None: all)."""
        rows = cols.shape[1]
        if not 0 < rows <= self.prompt_rows:
            raise ValueError(f"a fused step with prompts takes 1 to {self.prompt_rows} rows, not {rows}")
        self._fit(rows)
        kept = rows if keep is None else keep.shape[0]
        out = torch.empty(kept, self.hidden, dtype=self.dtype)
        ptr = decode_step.ptr
        step = decode_step.StepDesc(
            rows,
            ptr(cols[0]),
            ptr(cols[1]),
            ptr(cols[2]),
            num_decodes,
            ptr(table),
            table.shape[1],
            ptr(lengths),
            chunks.shape[1],
            ptr(table[num_decodes:]),
            table.shape[1],
            ptr(chunks[0]),
            ptr(chunks[1]),
            ptr(chunks[2]),
            kept,
            ptr(keep),
        )
        return out if decode_step.model_step(self.desc, step, out) else None

    def _fit(self, rows: int) -> None:
        """Scratch for `rows` rows: grown (never shrunk) to the longest step seen, which the
        scheduler's token budget bounds, as the modules' activations are."""
        if rows <= self.scratch["residual"].shape[0]:
            return
        for name, width in self.scratch_cols.items():
            buffer = torch.empty(rows, width, dtype=self.dtype)
            self.scratch[name] = buffer
            setattr(self.desc, name, buffer.data_ptr())


def _first_rows(buffer: torch.Tensor, views: dict[int, torch.Tensor], n: int) -> torch.Tensor:
    """buffer[:n], made once per n (a torch slice per step costs more than the lookup)."""
    view = views.get(n)
    if view is None:
        view = views[n] = buffer[:n]
    return view


def build_fused_decoder(
    model: LlamaForCausalLM, kv_caches: list[PagedKV], max_rows: int
) -> tuple[FusedDecoder | None, str]:
    """The fused decode step, or None and why not (the caller logs it)."""
    inner, cfg = model.model, model.cfg
    attn0 = inner.layers[0].self_attn
    head_dim, inner_size = attn0.head_dim, inner.layers[0].mlp.size
    why = _unsupported(model, kv_caches)
    if why:
        return None, why
    dtype = inner.embed_tokens.weight.dtype
    kinds = BF16_KINDS if dtype == torch.bfloat16 else F32_KINDS
    linears: list[list[NativeLinear]] = []
    for layer in inner.layers:
        parts = [
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ]
        found = [_native(p) for p in parts]
        if any(f is None for f in found):
            return None, "a linear layer runs on oneDNN's or PyTorch's product, not one of our kernels"
        if any(f.kind not in kinds for f in found):  # type: ignore[union-attr]
            return None, f"a linear layer's kernel is not one the {dtype} step calls"
        linears.append(found)  # type: ignore[arg-type]
    limits = [lin.max_rows for row in linears for lin in row if lin.max_rows is not None]
    rows = min([max_rows, *limits])
    # steps with prompt chunks: where every layer's chunks go to the prefill kernel (as the
    # backend sends them: no window to cut them), up to the rows every linear kernel takes
    windowed = any(layer.self_attn.window is not None for layer in inner.layers)
    prompt_rows = 0 if windowed or not prefill_kernel_takes(dtype, head_dim) else min(limits, default=1 << 40)

    keep: list[object] = []
    layer_descs = (decode_step.LayerDesc * len(inner.layers))()
    for desc, layer, (qkv, o, gate_up, down), cache in zip(layer_descs, inner.layers, linears, kv_caches):
        attn = layer.self_attn
        desc.input_norm = layer.input_layernorm.weight.data_ptr()
        desc.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        desc.q_norm = attn.q_norm.weight.data_ptr() if attn.q_norm is not None else None
        desc.k_norm = attn.k_norm.weight.data_ptr() if attn.k_norm is not None else None
        desc.qkv, desc.o = decode_step.linear_desc(qkv), decode_step.linear_desc(o)
        desc.gate_up, desc.down = decode_step.linear_desc(gate_up), decode_step.linear_desc(down)
        desc.k_cache, desc.v_cache = cache.data[0].data_ptr(), cache.data[1].data_ptr()
        desc.window = attn.window or 0  # the kernel reads only the window's positions
        keep += [qkv, o, gate_up, down, cache]
    keep.append(layer_descs)

    hidden = cfg.hidden_size
    width = (attn0.num_heads + 2 * attn0.num_kv_heads) * head_dim
    # the bf16 step's tile products end in SiLU(gate) * up: their gate/up rows need no buffer
    gate_ups = [row[2] for row in linears]
    fused_gate = dtype == torch.bfloat16 and all(g.kind == NativeKind.AMX_BF16 and g.gated for g in gate_ups)
    scratch = {
        "residual": hidden,
        "normed": hidden,
        "qkv": width,
        "attn": attn0.num_heads * head_dim,
        "gate_up": 0 if fused_gate else 2 * inner_size,
        "act": inner_size,
        "delta": hidden,
    }
    buffers = {name: torch.empty(rows, cols, dtype=dtype) for name, cols in scratch.items()}
    desc = decode_step.DecoderDesc(
        num_layers=len(inner.layers),
        hidden=hidden,
        heads=attn0.num_heads,
        kv_heads=attn0.num_kv_heads,
        head_dim=head_dim,
        inner=inner_size,
        block_size=kv_caches[0].block_size,
        eps=inner.norm.eps,
        scale=attn0.scale,
        layers=layer_descs,
        embed=inner.embed_tokens.weight.data_ptr(),
        final_norm=inner.norm.weight.data_ptr(),
        cos=inner.rotary.cos.data_ptr(),
        sin=inner.rotary.sin.data_ptr(),
        **{name: t.data_ptr() for name, t in buffers.items()},
        one_region=int(native.one_region_steps()),
    )
    keep.append(model)  # its weights, norms, embedding and rotary tables
    return FusedDecoder(desc, rows, hidden, dtype, keep, prompt_rows, scratch, buffers), ""


def _native(linear: Linear) -> NativeLinear | None:
    if linear.reduce_output:
        return None
    return linear.method.native_linear(linear)


def _unsupported(model: LlamaForCausalLM, kv_caches: list[PagedKV]) -> str:
    """Why the fused step cannot reproduce the modules here ("" if it can)."""
    inner, cfg = model.model, model.cfg
    attn0, mlp0 = inner.layers[0].self_attn, inner.layers[0].mlp
    dtype = inner.embed_tokens.weight.dtype
    if dtype == torch.bfloat16:
        if native.library() is None:
            return "our AVX-512 BF16 kernels do not run here"
        # the shapes each kernel takes (layer_kernels.c); the modules fall back to PyTorch otherwise
        if cfg.hidden_size % 16 or attn0.head_dim % 32 or attn0.head_dim > 256 or mlp0.size % 16:
            return "hidden, head or MLP sizes our kernels do not take"
    elif dtype == torch.float32:
        if native.avx2_library() is None:
            return "our AVX2 kernels do not run here"
        # layer_kernels_f32.c's shapes, as the native ops table and backend check them
        if cfg.hidden_size % 8 or attn0.head_dim % 16 or attn0.head_dim > 256:
            return "hidden or head sizes our kernels do not take"
        if attn0.q_norm is not None:  # the modules norm q/k views with PyTorch: other float32 bits
            return "q/k norms in float32"
    else:
        return "the model runs in neither bf16 nor float32"
    if any(type(c) is not PagedKV or c.data.dtype != dtype for c in kv_caches):
        return "the KV cache is quantized"
    if attn0.qkv_proj.parallel.tp_size != 1:
        return "tensor parallel"
    if attn0.backend.name != "native":
        return f"the {attn0.backend.name} attention backend"
    if attn0.ops.name != "native":
        return "native kernels are off"
    return ""
