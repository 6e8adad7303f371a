"""The CPU capability profile: the level our kernels run at, decided once, and DOLMUS_CPU_ISA
capping it so that the lower paths run (and are checked against transformers) on any CPU that
can execute them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dolmus.runtime.cpu_profile import ISA_LEVELS, cpu_profile, detect_level

TESTS = Path(__file__).parent
HERE = cpu_profile()


def test_levels_from_flags() -> None:
    if HERE.detected == "none":
        pytest.skip("not an x86-64 Linux host")
    avx2 = {"avx2", "fma", "f16c", "sse4_2"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    assert detect_level({"sse4_2"}) == "none"
    assert detect_level(avx2) == "avx2"
    assert detect_level(avx2 | {"avx512f", "avx512bw", "avx512vl"}) == "avx2"  # no BF16: not ours
    assert detect_level(avx512) == "avx512"
    assert detect_level(avx512 | {"amx_tile", "amx_bf16"}) == "amx"
    assert detect_level(avx2 | {"amx_tile", "amx_bf16"}) == "avx2"  # a level needs those below it


PROFILE_ONLY = "from dolmus.runtime.cpu_profile import cpu_profile; cpu_profile()"


def _run(script: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_vars}
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )


CAPPED = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    import torch
    from conftest import build_model_dir
    from helpers import hf_greedy, random_prompts
    from dolmus import LLM, SamplingParams
    from dolmus.runtime import native
    from dolmus.runtime.cpu_profile import cpu_profile

    profile = cpu_profile()
    assert profile.isa == {isa!r}, profile
    assert not any(f.startswith(("avx512", "amx")) for f in profile.flags), "flags above the cap"
    above = profile.detected != profile.isa
    assert ("-mno-avx512f" in profile.compile_flags) == (above and profile.detected in ("avx512", "amx"))
    if {isa!r} == "avx2":
        assert native.library() is None and not native.cpu_has_bf16()
        assert native.avx2_library() is not None  # the float32 kernels, built without AVX-512
    else:
        assert native.library() is None and native.avx2_library() is None
    folder = build_model_dir("llama", Path({root!r}), dtype=torch.bfloat16)
    prompts = random_prompts(lengths=(1, 17, 40), seed=2)
    llm = LLM(model=str(folder))  # a bf16 checkpoint: float32 where bf16 is emulated
    runner = llm.engine.executor.runner
    assert runner.dtype == torch.float32, runner.dtype
    assert runner.native_kernels == ({isa!r} == "avx2"), runner.native_kernels
    if {isa!r} == "avx2":  # the bf16 weights stay bf16 under float32 (half the bytes)
        from dolmus.runtime.layers.linear import Linear
        from dolmus.runtime.layers.unquantized import Bf16Weights
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert linears and all(isinstance(m.method_state, Bf16Weights) for m in linears)
        assert runner.fused_decoder is not None  # decode_step_f32.c
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    want = [hf_greedy(folder, p, 12) for p in prompts]
    assert got == want, (got, want)
    print("ok")
    """
)


@pytest.mark.parametrize("isa", ["avx2", "none"])
def test_a_capped_level_runs_its_own_path(isa: str, tmp_path: Path) -> None:
    if ISA_LEVELS.index(HERE.detected) < ISA_LEVELS.index(isa) or HERE.detected == "none":
        pytest.skip(f"this CPU has no {isa} level")
    proc = _run(CAPPED.format(tests=str(TESTS), isa=isa, root=str(tmp_path)), DOLMUS_CPU_ISA=isa)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


def test_a_cap_above_the_cpu_or_unknown_is_refused() -> None:
    proc = _run(PROFILE_ONLY, DOLMUS_CPU_ISA="sse9")
    assert proc.returncode != 0 and "DOLMUS_CPU_ISA must be one of" in proc.stderr
    if HERE.detected != "amx" and not HERE.amx_emulated:
        proc = _run(PROFILE_ONLY, DOLMUS_CPU_ISA="amx")
        assert proc.returncode != 0 and f"up to {HERE.detected} only" in proc.stderr


def test_profile_facts() -> None:
    assert HERE.cores >= 1 and HERE.huge_pages in ("always", "madvise", "never", "unknown")
    assert HERE.isa in ISA_LEVELS and HERE.model
    assert "kernels at" in HERE.summary() and "flags" not in HERE.as_dict()


def _suite_under(files: list[str], **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_vars}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        *(str(TESTS / f) for f in files),
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


def test_the_avx2_kernels_built_without_avx512() -> None:
    """On a CPU with AVX-512 the AVX2 library is otherwise compiled with -march=native (and may
    use AVX-512); capped, its tests run the code an AVX2-only host runs."""
    if ISA_LEVELS.index(HERE.detected) < ISA_LEVELS.index("avx512"):
        pytest.skip("the suite already runs the AVX2 kernels as an AVX2-only host builds them")
    proc = _suite_under(
        [
            "test_native_f32_kernels.py",
            "test_gguf_blocks.py",
            "test_bf16_weights.py",
            "test_fused_decode_f32.py",
        ],
        DOLMUS_CPU_ISA="avx2",
    )
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_the_avx512_paths_on_an_amx_cpu() -> None:
    """On an AMX CPU the bf16 kernels' AVX-512 paths (what AMD EPYC runs) are otherwise never
    taken; capped at avx512, the tile code is compiled out and their tests run those paths."""
    if HERE.detected != "amx":
        pytest.skip("no AMX here: the suite already runs the AVX-512 paths")
    proc = _suite_under(
        ["test_native_kernels.py", "test_bf16_gemm.py", "test_fused_decode.py"], DOLMUS_CPU_ISA="avx512"
    )
    assert proc.returncode == 0, proc.stdout[-4000:]


EMULATED = textwrap.dedent(
    """
    from dolmus.runtime import native
    from dolmus.runtime.cpu_profile import cpu_profile

    profile = cpu_profile()
    assert profile.isa == "amx" and profile.amx_emulated and profile.detected == "avx512", profile
    assert "-DDOLMUS_AMX_EMULATE" in profile.compile_flags and "emulated" in profile.summary()
    assert native.amx_ready() and native.tile_gemm_ready()
    print("ok")
    """
)


def test_the_amx_paths_on_the_tiles_model_where_there_is_no_amx() -> None:
    """Without an AMX host the tile paths (bf16 products, prompt attention, quantized products at
    several rows) would go untested until one is lent; DOLMUS_AMX_EMULATE=1 builds them on the
    tiles' software model (native/amx_tiles.h) and their tests run against the same references."""
    if HERE.detected != "avx512":
        pytest.skip("the model runs on an AVX-512 BF16 CPU without AMX; an AMX CPU runs the tiles")
    if os.environ.get("DOLMUS_CPU_ISA"):
        pytest.skip("the suite runs capped by DOLMUS_CPU_ISA: the cap's own paths are its subject")
    proc = _run(EMULATED, DOLMUS_AMX_EMULATE="1")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
    proc = _suite_under(
        [
            "test_bf16_gemm.py",
            "test_native_kernels.py",
            "test_fused_decode.py",
            "test_quant_kernels.py",
            "test_gguf_blocks.py",
        ],
        DOLMUS_AMX_EMULATE="1",
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "on AMX the tiles are always taken" in proc.stdout, proc.stdout[-2000:]  # it ran on the tiles


def test_the_tiles_model_is_refused_where_it_does_not_apply() -> None:
    if HERE.detected == "avx512":
        pytest.skip("this CPU takes the model")
    if os.environ.get("DOLMUS_CPU_ISA"):
        pytest.skip("the suite runs capped by DOLMUS_CPU_ISA")
    proc = _run(PROFILE_ONLY, DOLMUS_AMX_EMULATE="1")
    assert proc.returncode != 0 and "DOLMUS_AMX_EMULATE=1 models AMX" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(
    "march, defines", [("sapphirerapids", []), ("cooperlake", []), ("cooperlake", ["-DDOLMUS_AMX_EMULATE"])]
)
def test_the_avx512_library_compiles_with_and_without_amx(march: str, defines: list[str]) -> None:
    """Its sources share headers whose AMX parts exist only in AMX builds: a name clash there
    (a second `block_steps`) broke the whole library on AMX hosts while AMD ones built it.
    Compiled for an AMX CPU, for one with AVX-512 BF16 only, and for the latter with the tiles'
    software model, whatever this host is."""
    from dolmus.runtime import native

    compiler = native.find_compiler()
    if compiler is None or native.platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs an x86-64 C compiler")
    folder = Path(native.__file__).parent
    for source in native._AVX512.sources:
        proc = subprocess.run(
            [
                compiler,
                "-O1",
                f"-march={march}",
                *defines,
                "-fopenmp",
                "-std=c11",
                "-fsyntax-only",
                str(folder / source),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"{source} for {march}: {proc.stderr[-1500:]}"


@pytest.mark.parametrize("march", ["sapphirerapids", "cooperlake"])
@pytest.mark.parametrize("source", ["quant_kernels.c", "int8_kernels.c"])
def test_the_weight_streams_keep_their_prefetches(source: str, march: str, tmp_path: Path) -> None:
    """GCC 12 deleted every _mm_prefetch of the int4 and per-row int8 products as dead code once
    their blocks were inlined (the one-sequence Q4_0 decode on an AMX Xeon took 18 ms a step
    instead of 12); prefetch.h's requests are now volatile asm. Compiled with the library's own
    optimisation flags, for an AMX CPU and for one with AVX-512 BF16 only, each file still asks
    for its weights ahead."""
    from dolmus.runtime import native

    compiler = native.find_compiler()
    if compiler is None or native.platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs an x86-64 C compiler")
    flags = [f for f in native.FLAGS if f not in ("-march=native", "-shared")]
    path, out = Path(native.__file__).with_name(source), tmp_path / "kernels.s"
    command = [compiler, *flags, f"-march={march}", "-S", str(path), "-o", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert "prefetcht1" in out.read_text(), f"{source} for {march}: no prefetch instruction left"
