"""The kernel table: each layout packs and reads back the weight it is given; layers hold one typed state."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dolmus import LLM
from dolmus.quant import kernels
from dolmus.quant.kernels import KERNELS, Int4Kernel, Int8Kernel, device_kind, int4_kernel, int8_kernel
from dolmus.quant.state import Int4State, Int8State
from dolmus.quant.weight_only import Int4WeightOnlyMethod, Int8WeightOnlyMethod
from dolmus.runtime import native as runtime_native
from dolmus.runtime.layers.linear import Linear

LAYERS = Path(__file__).parent.parent / "dolmus" / "runtime" / "layers"


def _int8(n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, generator=gen) / 50).to(dtype)
    return codes, scale, codes.float() * scale.float()[:, None]


def _int4(n: int, k: int, group: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n + k + group)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale = torch.rand(n, k // group, generator=gen) / 10
    zero = torch.randn(n, k // group, generator=gen) / 10
    return codes, scale, zero


needs_avx2 = pytest.mark.skipif(
    runtime_native.avx2_library() is None, reason="the block kernels need x86-64 with AVX2, FMA and F16C"
)
BLOCKS = pytest.param("cpu_blocks", marks=needs_avx2)  # dequantizes through its C kernel


@pytest.mark.parametrize("kind", ["cuda", "cpu_native", BLOCKS, "cpu"])
def test_int8_layouts_read_back_their_codes(kind: str) -> None:
    """Packing and dequantizing are plain tensor code for every kernel but the block kernels'
    (their C decoding), so all run here."""
    kernel = KERNELS["int8", kind]
    assert isinstance(kernel, Int8Kernel)
    for n, k in ((100, 64), (48, 32 if kind == "cpu_blocks" else 40)):
        codes, scale, w = _int8(n, k, torch.float32)
        state = kernel.pack(codes, scale)
        assert state.kernel is kernel and state.shape == (n, k)
        torch.testing.assert_close(kernel.dequantize(state), w, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["cuda", "cpu_native", BLOCKS, "cpu"])
def test_int4_layouts_read_back_their_codes(kind: str) -> None:
    kernel = KERNELS["int4", kind]
    assert isinstance(kernel, Int4Kernel)
    for n, k, group in ((64, 128, 32), (48, 64, 64)):
        codes, scale, zero = _int4(n, k, group)
        dtype = torch.bfloat16 if kind == "cpu_native" else torch.float32
        state = kernel.pack(codes, scale, zero, group, dtype)
        assert state.kernel is kernel and state.shape == (n, k) and state.group_size == group
        s, z = (t.to(dtype).float().repeat_interleave(group, 1) for t in (scale, zero))
        torch.testing.assert_close(kernel.dequantize(state), (codes - 8) * s + z, rtol=0, atol=1e-6)


@needs_avx2
def test_the_block_kernels_multiply_as_their_weights_at_every_size() -> None:
    """float32 layers on AVX2 (`cpu_blocks`): one row (decode: scales and minima outside the
    inner products), the row tiles, the strips and the dequantize-and-GEMM path, against the
    float64 product of the weight the kernel holds; int4 groups of 32 and 128."""
    gen = torch.Generator().manual_seed(5)
    codes, scale, _ = _int8(70, 256, torch.float32)
    states = [KERNELS["int8", "cpu_blocks"].pack(codes, scale)]
    states += [KERNELS["int4", "cpu_blocks"].pack(*_int4(70, 256, g), g, torch.float32) for g in (32, 128)]
    for state in states:
        w = state.kernel.dequantize(state).double()
        for m in (1, 2, 3, 5, 64, 65):
            x = torch.randn(m, 256, generator=gen)
            y = state.kernel.matmul(state, x)
            torch.testing.assert_close(y, (x.double() @ w.T).float(), rtol=1e-5, atol=1e-4)


def test_the_plain_cpu_kernels_compute_with_what_they_hold() -> None:
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    codes, scale, _ = _int8(48, 64, torch.float32)
    state8 = KERNELS["int8", "cpu"].pack(codes, scale)
    torch.testing.assert_close(state8.kernel.matmul(state8, x), x @ state8.kernel.dequantize(state8).T)
    state4 = KERNELS["int4", "cpu"].pack(*_int4(48, 64, 32), 32, torch.float32)
    torch.testing.assert_close(state4.kernel.matmul(state4, x), x @ state4.kernel.dequantize(state4).T)


def test_kernels_are_chosen_by_device_kind(monkeypatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert device_kind(cuda, torch.bfloat16, True) == "cuda"
    monkeypatch.setattr(kernels.runtime_native, "library", lambda: object())  # as if our kernels built
    assert device_kind(cpu, torch.bfloat16, True) == "cpu_native"
    monkeypatch.setattr(kernels.runtime_native, "avx2_library", lambda: object())
    assert device_kind(cpu, torch.float32, True) == "cpu_blocks"  # AVX2's block kernels
    assert int8_kernel(cpu, torch.float32, True, 48, 64).name == "blocks"
    assert int8_kernel(cpu, torch.float32, True, 48, 40).name == "torch"  # blocks of 32 inputs
    assert device_kind(cpu, torch.bfloat16, False) == "cpu"
    assert device_kind(cpu, torch.float32, False) == "cpu"
    assert int4_kernel(cpu, torch.bfloat16, True).name == "native"
    assert int8_kernel(cpu, torch.bfloat16, True, 48, 64).name == "native"
    assert int8_kernel(cpu, torch.bfloat16, True, 48, 63).name == "native"  # inputs padded to quads
    assert int8_kernel(cpu, torch.bfloat16, True, 48, 65536).name == "torch"  # past exact int32 sums
    monkeypatch.setattr(kernels.runtime_native, "library", lambda: None)
    assert device_kind(cpu, torch.bfloat16, True) == "cpu_blocks"  # bf16 on AVX2 alone
    monkeypatch.setattr(kernels.runtime_native, "avx2_library", lambda: None)
    assert device_kind(cpu, torch.bfloat16, True) == "cpu"


def test_a_bf16_layer_packs_for_our_kernel_where_it_builds(monkeypatch) -> None:
    """The layout our AVX-512 kernels read holds the same weights as PyTorch's (the kernel
    itself is only called where the CPU has it: test_native_kernels.py)."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    held = {}
    for native in (False, True):
        monkeypatch.setattr(kernels.runtime_native, "library", lambda: object())
        for method in (Int8WeightOnlyMethod(native), Int4WeightOnlyMethod(32, native=native)):
            layer = Linear(128, 64, False, torch.bfloat16, method)
            layer.weight.data.copy_(w)
            layer.process_weights_after_loading()
            held[native, type(layer.method_state)] = layer.method_state
            assert layer.method_state.kernel.name == ("native" if native else "torch")
            assert layer.weight.numel() == 0 and not list(layer.buffers())  # the state holds it all
    for state in (Int8State, Int4State):
        ours, theirs = held[True, state], held[False, state]
        # (PyTorch's int4 weights come back through its kernel, rounded to bf16)
        torch.testing.assert_close(
            ours.kernel.dequantize(ours), theirs.kernel.dequantize(theirs), rtol=2**-8, atol=1e-6
        )


def test_quantized_layers_keep_one_typed_state(model_dir) -> None:
    llm = LLM(model=str(model_dir), dtype="float32", quantization="int4")
    for name, layer in llm.engine.runner.model.named_modules():
        if isinstance(layer, Linear):
            assert isinstance(layer.method_state, (Int4State, Int8State)), name
            assert not list(layer.buffers()), name


def test_the_layer_modules_import_no_quantization_code() -> None:
    """The dependency points one way: quant implements the layers' contract."""
    for path in LAYERS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            assert not any(n.startswith("dolmus.quant") for n in names), (path.name, names)
