"""The engine's quantization choice (EngineConfig.quantization and friends) as a linear method."""

from __future__ import annotations

from dolmus.quant.fp8 import Fp8WeightOnlyMethod
from dolmus.quant.w8a8 import W8A8DynamicMethod
from dolmus.quant.weight_only import Int4WeightOnlyMethod, Int8WeightOnlyMethod
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.unquantized import UnquantizedLinearMethod


def make_linear_method(
    prepack: bool,
    quantization: str | None = None,
    group_size: int = 32,
    symmetric: bool = False,
    head: str = "int8",
    native_kernels: bool = True,
) -> LinearMethod:
    if quantization is None:
        return UnquantizedLinearMethod(prepack=prepack, native=native_kernels)
    if quantization == "int8":
        return Int8WeightOnlyMethod(native_kernels)
    if quantization == "int4":
        return Int4WeightOnlyMethod(group_size, symmetric, head, native_kernels)
    if quantization == "fp8":
        return Fp8WeightOnlyMethod()
    if quantization == "w8a8":
        return W8A8DynamicMethod()
    raise ValueError(f"quantization must be int8, int4, fp8 or w8a8, got {quantization!r}")
