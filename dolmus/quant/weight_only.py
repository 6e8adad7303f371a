"""Weight-only int8 and int4 quantization on load, run by fused CPU kernels.

Decode at batch 1 reads every weight once per token, so fewer bytes per weight is speed:
the checkpoint loads in its float dtype as usual, then each linear layer quantizes itself
in `process_weights_after_loading`:

- int8, per output channel, symmetric;
- int4, group-wise (32/64/128 inputs per group), with zero points or symmetric. Dequantized,
  an int4 weight is (q - 8) * scale + zero per group (zero = 0 when symmetric), PyTorch's
  convention.

bf16 layers multiply with our AVX-512 kernels (quant/native.py wrapping
runtime/native/quant_kernels.c), which stream the weights at memory bandwidth; elsewhere
(fp32 runs, CPUs without AVX-512 BF16, no C compiler, `native_kernels=False`) with PyTorch's
`_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`, which are compute-bound here at
about half that. On a CUDA GPU both run on our Triton kernel (triton_kernels.py), which
dequantizes tiles in registers for the tensor cores. A layer whose input size is not a
multiple of the group size (or, on PyTorch's int4 kernel, whose output size is not a
multiple of 16) is int8 instead, logged. Under int4 the LM head is int8 by default
(`quant_lm_head`): a 151,936-wide head is a quarter of a 0.5B model, and at 8 bits it keeps
quality, as llama.cpp keeps its output layer at higher precision.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dolmus.quant import native, triton_kernels
from dolmus.runtime import native as runtime_native
from dolmus.runtime.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod

logger = logging.getLogger(__name__)

INT4_GROUP_SIZES = (32, 64, 128)
LM_HEAD_FORMATS = ("w8a8", "int8", "int4")  # the LM head's format under int4


class _QuantizeOnLoad(LinearMethod):
    """Loads a float weight like an unquantized layer, then swaps it for quantized buffers."""

    devices = ("cpu", "cuda")  # where the method has kernels (cuda: triton_kernels.py)

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        UnquantizedLinearMethod(prepack=False).create_weights(layer, dtype)

    def process_weights_after_loading(self, layer: Linear) -> None:
        device = layer.weight.device
        if device.type not in self.devices:
            raise ValueError(f"{type(self).__name__} runs on {' or '.join(self.devices)}, not {device.type}")
        if device.type == "cuda" and not triton_kernels.available():
            raise ValueError("int8/int4 weights on a GPU need Triton (pip install triton)")
        self.quantize(layer, layer.weight.detach().float())
        if not layer.weight_shared:  # a tied head's float weight is the embedding's
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=device)

    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        raise NotImplementedError

    @staticmethod
    def _flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])

    @staticmethod
    def _finish(layer: Linear, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y + layer.bias if layer.bias is not None else y


class Int8WeightOnlyMethod(_QuantizeOnLoad):
    # PyTorch's kernel reads past the end of rows whose length is not a multiple of 16 (a
    # crash with more than one input row, seen in torch 2.13): such weights get zero columns.
    _K_MULTIPLE = 16

    def __init__(self, native: bool = True) -> None:
        self.native = native  # our AVX-512 kernel for bf16 layers where it builds (native.py)

    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
        q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
        scale = scale.to(layer.weight.dtype)
        layer.int8_shape = tuple(w.shape)
        layer.layout = _layout(self.native, layer)
        if layer.layout == "native" and w.shape[1] % 2:  # our kernel reads inputs in pairs
            layer.layout = "torch"
        if layer.layout == "triton":
            _set_buffer(layer, "qweight", q.contiguous())
            _set_buffer(layer, "scales", scale.float())
            return
        if layer.layout == "native":
            packed, scale = native.pack_int8(q, scale)
            _set_buffer(layer, "qweight", packed)
            _set_buffer(layer, "scales", scale)
            return
        layer.int8_pad = -w.shape[1] % self._K_MULTIPLE
        _set_buffer(layer, "qweight", F.pad(q, (0, layer.int8_pad)))
        _set_buffer(layer, "scales", scale)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        flat = self._flat(x)
        n = layer.int8_shape[0]
        if layer.layout == "triton":
            y = triton_kernels.weight_only_matmul(flat, layer.qweight, layer.scales, None, n, 8)
            return self._finish(layer, y, x.shape)
        if layer.layout == "native":
            y = native.int8_matmul(flat, layer.qweight, layer.scales, n)
            return self._finish(layer, y, x.shape)
        if layer.int8_pad:
            flat = F.pad(flat, (0, layer.int8_pad))
        y = torch.ops.aten._weight_int8pack_mm(flat, layer.qweight, layer.scales)
        return self._finish(layer, y, x.shape)

    @staticmethod
    def dequantize(layer: Linear) -> torch.Tensor:
        n, k = layer.int8_shape
        if layer.layout == "triton":
            return layer.qweight.float() * layer.scales[:, None]
        if layer.layout == "native":
            codes = layer.qweight.transpose(1, 2).reshape(-1, k)[:n]
            return codes.float() * layer.scales[:n, None]
        return layer.qweight[:, :k].float() * layer.scales.float()[:, None]


class Int4WeightOnlyMethod(_QuantizeOnLoad):
    def __init__(
        self, group_size: int = 32, symmetric: bool = False, head: str = "int8", native: bool = True
    ) -> None:
        # PyTorch's kernel takes these groups; ours any even size (a checkpoint's may differ)
        if group_size not in INT4_GROUP_SIZES and not (native and group_size > 0 and group_size % 2 == 0):
            raise ValueError(f"quant_group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if head not in LM_HEAD_FORMATS:
            raise ValueError(f"quant_lm_head must be one of {LM_HEAD_FORMATS}, got {head!r}")
        self.group_size = group_size
        self.symmetric = symmetric
        self.head = head
        self.native = native
        self._int8 = Int8WeightOnlyMethod(native)

    def head_method(self) -> LinearMethod:
        if self.head == "int4":
            return self
        return W8A8DynamicMethod() if self.head == "w8a8" else self._int8

    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        n, k = w.shape
        g = self.group_size
        layer.layout = _layout(self.native, layer)
        if k % g or (n % 16 and layer.layout == "torch"):  # PyTorch's kernel layout needs both
            logger.info("int4: a %dx%d layer does not fit groups of %d (or 16 outputs); it is int8", n, k, g)
            layer.method = self._int8  # this layer's compute follows its storage
            self._int8.quantize(layer, w)
            return
        # 512 rows at a time: the search's temporaries stay in cache (~4x faster than whole layers)
        parts = [fit_int4_groups(rows.reshape(-1, k // g, g), self.symmetric) for rows in w.split(512)]
        q, scale, zero = (torch.cat(t) for t in zip(*parts))
        self.store(layer, q.to(torch.int32).reshape(n, k), scale, zero)

    def store(self, layer: Linear, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Codes [N, K] in 0..15 with scale and zero [N, K/group] into the kernel's layout."""
        n, k = codes.shape
        layer.int4_codes_shape = (n, k)
        if layer.layout == "triton":
            _set_buffer(layer, "qweight", triton_kernels.pack_int4(codes))
            _set_buffer(layer, "scales", scale.float().contiguous())
            _set_buffer(layer, "zeros", zero.float().contiguous())
            return
        if layer.layout == "native":
            packed, scales, zeros = native.pack_int4(codes, scale, zero)
            _set_buffer(layer, "qweight", packed)
            _set_buffer(layer, "scales", scales)
            _set_buffer(layer, "zeros", zeros)
            return
        _set_buffer(layer, "qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [k/g, n, 2]
        _set_buffer(layer, "scales_zeros", scales_zeros.to(layer.weight.dtype))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.layout == "triton":
            n, g = layer.int4_codes_shape[0], self.group_size
            y = triton_kernels.weight_only_matmul(
                self._flat(x), layer.qweight, layer.scales, layer.zeros, n, 4, g
            )
            return self._finish(layer, y, x.shape)
        if layer.layout == "native":
            n = layer.int4_codes_shape[0]
            y = native.int4_matmul(
                self._flat(x), layer.qweight, layer.scales, layer.zeros, n, self.group_size
            )
            return self._finish(layer, y, x.shape)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            self._flat(x), layer.qweight, self.group_size, layer.scales_zeros
        )
        return self._finish(layer, y, x.shape)

    def dequantize(self, layer: Linear) -> torch.Tensor:
        """The float weight the kernel computes with."""
        n, k = layer.int4_codes_shape
        if layer.layout == "triton":
            codes = triton_kernels.unpack_int4(layer.qweight).float()
            g = self.group_size
            return (codes - 8) * layer.scales.repeat_interleave(g, 1) + layer.zeros.repeat_interleave(g, 1)
        if layer.layout == "native":
            codes = native.unpack_int4(layer.qweight, n, k).float()
            scale = layer.scales[:, :n].float().T.repeat_interleave(self.group_size, dim=1)
            if layer.zeros is None:  # symmetric: no zero points stored
                return (codes - 8) * scale
            zero = layer.zeros[:, :n].float().T.repeat_interleave(self.group_size, dim=1)
            return (codes - 8) * scale + zero
        # PyTorch's layout: an identity matrix through the kernel
        eye = torch.eye(k, dtype=layer.scales_zeros.dtype)
        return (
            torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, layer.qweight, self.group_size, layer.scales_zeros
            )
            .float()
            .T
        )


# Without VNNI, fbgemm multiplies u8 x s8 pairs into int16 (vpmaddubsw), which saturates on
# full-range activations (measured on an AVX2 EPYC: 7% relative error); 7-bit activations
# cannot saturate there (1.2%). With VNNI the products accumulate in int32 and 8 bits are safe.
_REDUCE_RANGE = not runtime_native.has_int8_dot_products()


class W8A8DynamicMethod(_QuantizeOnLoad):
    """int8 weights (per channel) times int8 activations quantized per call (fbgemm).

    Not weight-only: each call quantizes its input to int8 too, so the product runs on the
    CPU's int8 dot-product units. Measured here it is ~1.7x bf16 at batch 1 (our int8
    kernel: ~2.3x) and still ~1.6x at batch 32, where weight-only int8 is slower than bf16;
    the price is a little more error (activations at 8 bits).
    """

    devices = ("cpu",)  # fbgemm

    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated, fbgemm's kernels are not gone yet
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            bias = layer.bias.detach().float() if layer.bias is not None else None
            layer.w8a8_packed = torch.ops.quantized.linear_prepack(qweight, bias)
        layer.opaque_weight_bytes = w.numel() + 8 * w.shape[0]  # int8 codes and scales, in fbgemm's pack

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(self._flat(x).float(), layer.w8a8_packed, _REDUCE_RANGE)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])  # the bias is inside the kernel

    @staticmethod
    def dequantize(layer: Linear) -> torch.Tensor:
        qweight, _ = torch.ops.quantized.linear_unpack(layer.w8a8_packed)
        return qweight.dequantize()


class Fp8WeightOnlyMethod(_QuantizeOnLoad):
    """float8 e4m3 weights with a scale per output channel, for GPUs with fp8 support.

    Computes with `torch._scaled_mm` (activations scaled per row to e4m3 on the fly) where
    the GPU has it (compute capability 8.9 or newer), else by dequantizing into the
    activation dtype. CPUs have no fp8 matrix kernels: loading refuses with a clear error.
    """

    def process_weights_after_loading(self, layer: Linear) -> None:
        if layer.weight.device.type != "cuda":
            raise ValueError("fp8 weights need a CUDA GPU; on CPU use --quantization int8 or int4")
        self.quantize(layer, layer.weight.detach().float())
        if not layer.weight_shared:
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)

    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        codes, scale = fp8_quantize(w)
        _set_buffer(layer, "qweight", codes)
        _set_buffer(layer, "scales", scale)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        flat = self._flat(x)
        if _has_scaled_mm(flat.device):
            x_codes, x_scale = fp8_quantize(flat.float())
            y = torch._scaled_mm(
                x_codes,
                layer.qweight.T,
                scale_a=x_scale[:, None],
                scale_b=layer.scales[None, :],
                out_dtype=x.dtype,
            )
        else:
            y = flat @ self.dequantize(layer).to(flat.dtype).T
        return self._finish(layer, y, x.shape)

    @staticmethod
    def dequantize(layer: Linear) -> torch.Tensor:
        return fp8_dequantize(layer.qweight, layer.scales)


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `w` as e4m3 codes and float32 scales (row max maps to e4m3's 448)."""
    scale = (w.abs().amax(dim=-1) / 448.0).clamp(min=1e-12).float()
    return (w / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[:, None]


def _has_scaled_mm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def fit_int4_groups(groups: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, ...]:
    """Codes [.., G, g] in 0..15, scale and zero [.., G] for groups of weights [.., G, g].

    Each group's range is its min/max shrunk by the ratio of CLIP_RATIOS that gives the
    least squared error: clipping a rare outlier buys a finer step for the rest (the idea
    of llama.cpp's and AWQ's scale searches). Zero is the value of code 8 (the kernels').
    """
    best = None
    for ratio in CLIP_RATIOS:
        if symmetric:
            scale = (groups.abs().amax(-1) * ratio / 7).clamp(min=1e-8)
            zero = torch.zeros_like(scale)
            q = torch.round(groups / scale[..., None]).clamp(-8, 7) + 8
        else:
            low, high = groups.amin(-1) * ratio, groups.amax(-1) * ratio
            scale = ((high - low) / 15).clamp(min=1e-8)
            zero = low + 8 * scale
            q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        error = ((q - 8) * scale[..., None] + zero[..., None] - groups).square().sum(-1)
        if best is None:
            best = [q, scale, zero, error]
            continue
        better = error < best[3]
        best[0] = torch.where(better[..., None], q, best[0])
        for i, t in enumerate((scale, zero, error), start=1):
            best[i] = torch.where(better, t, best[i])
    return best[0], best[1], best[2]


def adopt_checkpoint_codes(layer: Linear) -> bool:
    """Run a GPTQ/AWQ layer's codes as stored on our int4 kernel, if it can take them;
    else write the float weight they stand for into the layer (False: quantize as usual)."""
    parts, layer.checkpoint_codes = layer.checkpoint_codes, {}
    groups = {p.group for p in parts.values()}
    group = groups.pop() if len(groups) == 1 else 0
    layout = _layout(getattr(layer.method, "native", True), layer)
    fits = (
        parts.keys() == layer.shard_offsets.keys()
        and all(p.g_idx is None for p in parts.values())  # act order scatters the groups
        and group % 2 == 0
        and layer.in_features % group == 0
        and (layout == "native" or (layout == "triton" and triton_kernels.available()))
    )
    if not fits:
        for shard, p in parts.items():
            start, size = layer.shard_offsets[shard]
            layer.weight.data.narrow(0, start, size).copy_(p.dequantize())
        layer.checkpoint_layout = "dequantized"
        return False
    ordered = [parts[shard] for shard in layer.shard_offsets]  # the stacking order
    scale = torch.cat([p.scale for p in ordered])
    zeros = torch.cat([p.zeros for p in ordered])
    layer.method = Int4WeightOnlyMethod(group, native=True)
    layer.layout = layout
    # (q - z) * s == (q - 8) * s + (8 - z) * s: our kernels' zero is the value of code 8
    device = layer.weight.device
    codes = torch.cat([p.codes for p in ordered]).to(device)
    layer.method.store(layer, codes, scale.to(device), ((8 - zeros) * scale).to(device))
    if not layer.weight_shared:
        layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=device)
    layer.checkpoint_layout = "int4 kernel"
    return True


def _layout(native_wanted: bool, layer: Linear) -> str:
    """Which kernel (and so which storage layout) a layer gets: triton on a GPU; on the CPU
    ours (native: bf16 activations, where the kernels build) or PyTorch's."""
    if layer.weight.device.type == "cuda":
        return "triton"
    ours = native_wanted and layer.weight.dtype == torch.bfloat16 and native.library() is not None
    return "native" if ours else "torch"


def _set_buffer(layer: Linear, name: str, value: torch.Tensor) -> None:
    if name in layer._buffers:
        layer._buffers[name] = value
    else:
        layer.register_buffer(name, value, persistent=False)


def make_quant_method(
    quantization: str, group_size: int, symmetric: bool, head: str = "int8", native_kernels: bool = True
) -> LinearMethod:
    if quantization == "int8":
        return Int8WeightOnlyMethod(native_kernels)
    if quantization == "int4":
        return Int4WeightOnlyMethod(group_size, symmetric, head, native_kernels)
    if quantization == "fp8":
        return Fp8WeightOnlyMethod()
    if quantization == "w8a8":
        return W8A8DynamicMethod()
    raise ValueError(f"quantization must be int8, int4, fp8 or w8a8, got {quantization!r}")


def module_bytes(model: nn.Module) -> int:
    """Bytes of weights as stored for compute: parameters, buffers and prepacked copies."""
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    for m in model.modules():
        packed = getattr(m, "packed_weight", None)
        if isinstance(packed, torch.Tensor):
            total += packed.numel() * packed.element_size()
        total += getattr(m, "opaque_weight_bytes", 0)  # weights a library holds outside tensors
    return total
