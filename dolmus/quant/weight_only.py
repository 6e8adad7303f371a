"""Weight-only int8 and int4 quantization on load, run by PyTorch's fused CPU kernels.

Decode at batch 1 reads every weight once per token, so fewer bytes per weight is speed:
the checkpoint loads in its float dtype as usual, then each linear layer quantizes itself
in `process_weights_after_loading` and multiplies with

- int8, per output channel, symmetric: `aten._weight_int8pack_mm`;
- int4, group-wise (32/64/128 inputs per group), with zero points or symmetric:
  `aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu`.

Dequantized, an int4 weight is (q - 8) * scale + zero per group (zero = 0 when symmetric):
the convention of those kernels. A layer whose input size is not a multiple of the group
size, or whose output size is not a multiple of 16, falls back to int8 (logged). Under int4
the LM head is w8a8 by default (`quant_lm_head`): a 151,936-wide head is a quarter of a 0.5B
model, and at 8 bits it keeps quality (as llama.cpp keeps its output layer at higher
precision) while fbgemm's int8 kernel runs it about as fast as int4 would.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dolmus.runtime.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod

logger = logging.getLogger(__name__)

INT4_GROUP_SIZES = (32, 64, 128)
LM_HEAD_FORMATS = ("w8a8", "int8", "int4")  # the LM head's format under int4


class _QuantizeOnLoad(LinearMethod):
    """Loads a float weight like an unquantized layer, then swaps it for quantized buffers."""

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        UnquantizedLinearMethod(prepack=False).create_weights(layer, dtype)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if layer.weight.device.type != "cpu":
            raise ValueError("int8/int4 weight-only quantization runs on CPU only for now")
        self.quantize(layer, layer.weight.detach().float())
        if not layer.weight_shared:  # a tied head's float weight is the embedding's
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)

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
    # The kernel reads past the end of rows whose length is not a multiple of 16 (a crash
    # with more than one input row, seen in torch 2.13): such weights get zero columns.
    _K_MULTIPLE = 16

    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
        q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
        layer.int8_pad = -w.shape[1] % self._K_MULTIPLE
        _set_buffer(layer, "qweight", F.pad(q, (0, layer.int8_pad)))
        _set_buffer(layer, "scales", scale.to(layer.weight.dtype))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        flat = self._flat(x)
        if layer.int8_pad:
            flat = F.pad(flat, (0, layer.int8_pad))
        y = torch.ops.aten._weight_int8pack_mm(flat, layer.qweight, layer.scales)
        return self._finish(layer, y, x.shape)

    @staticmethod
    def dequantize(layer: Linear) -> torch.Tensor:
        k = layer.qweight.shape[1] - layer.int8_pad
        return layer.qweight[:, :k].float() * layer.scales.float()[:, None]


class Int4WeightOnlyMethod(_QuantizeOnLoad):
    def __init__(self, group_size: int = 32, symmetric: bool = False, head: str = "w8a8") -> None:
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quant_group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if head not in LM_HEAD_FORMATS:
            raise ValueError(f"quant_lm_head must be one of {LM_HEAD_FORMATS}, got {head!r}")
        self.group_size = group_size
        self.symmetric = symmetric
        self.head = head
        self._int8 = Int8WeightOnlyMethod()

    def head_method(self) -> LinearMethod:
        if self.head == "int4":
            return self
        return W8A8DynamicMethod() if self.head == "w8a8" else self._int8

    def quantize(self, layer: Linear, w: torch.Tensor) -> None:
        n, k = w.shape
        g = self.group_size
        if k % g or n % 16:  # the kernel's layout needs both
            logger.info("int4: a %dx%d layer does not fit groups of %d (or 16 outputs); it is int8", n, k, g)
            layer.method = self._int8  # this layer's compute follows its storage
            self._int8.quantize(layer, w)
            return
        groups = w.reshape(n, k // g, g)
        if self.symmetric:
            scale = (groups.abs().amax(-1) / 7).clamp(min=1e-8)
            zero = torch.zeros_like(scale)
            q = torch.round(groups / scale[..., None]).clamp(-8, 7) + 8
        else:
            low, high = groups.amin(-1), groups.amax(-1)
            scale = ((high - low) / 15).clamp(min=1e-8)
            zero = low + 8 * scale  # the kernels' zero: the value of code 8
            q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        codes = q.to(torch.int32).reshape(n, k)
        _set_buffer(layer, "qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [k/g, n, 2]
        _set_buffer(layer, "scales_zeros", scales_zeros.to(layer.weight.dtype))
        layer.int4_codes_shape = (n, k)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            self._flat(x), layer.qweight, self.group_size, layer.scales_zeros
        )
        return self._finish(layer, y, x.shape)

    def dequantize(self, layer: Linear) -> torch.Tensor:
        """The float weight the kernel computes with (an identity matrix through the kernel)."""
        n, k = layer.int4_codes_shape
        eye = torch.eye(k, dtype=layer.scales_zeros.dtype)
        return (
            torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, layer.qweight, self.group_size, layer.scales_zeros
            )
            .float()
            .T
        )


class W8A8DynamicMethod(_QuantizeOnLoad):
    """int8 weights (per channel) times int8 activations quantized per call (fbgemm).

    Not weight-only: each call quantizes its input to int8 too, so the product runs on the
    CPU's int8 dot-product units. Measured here it is ~2x bf16 at batch 1 and still ~1.6x at
    batch 32, where the weight-only int8 kernel is slower than bf16; the price is a little
    more error (activations at 8 bits).
    """

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
        y = torch.ops.quantized.linear_dynamic(self._flat(x).float(), layer.w8a8_packed, False)
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


def _set_buffer(layer: Linear, name: str, value: torch.Tensor) -> None:
    if name in layer._buffers:
        layer._buffers[name] = value
    else:
        layer.register_buffer(name, value, persistent=False)


def make_quant_method(
    quantization: str, group_size: int, symmetric: bool, head: str = "w8a8"
) -> LinearMethod:
    if quantization == "int8":
        return Int8WeightOnlyMethod()
    if quantization == "int4":
        return Int4WeightOnlyMethod(group_size, symmetric, head)
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
