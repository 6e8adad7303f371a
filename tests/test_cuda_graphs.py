"""The CUDA path's logic on the CPU: the Triton attention backend (under Triton's interpreter)
and the CUDA-graph decode bookkeeping (ladder, padding rows, the spare block, buffer reuse),
each replay emulated by a call on the same static buffers. Greedy tokens against transformers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dolmus.runtime.block_table import BlockTable
from dolmus.runtime.cuda_graphs import graph_sizes

pytest.importorskip("triton")

TESTS = Path(__file__).parent


def test_graph_ladder() -> None:
    assert graph_sizes(1) == [1]
    assert graph_sizes(6) == [1, 2, 4, 6]
    assert graph_sizes(8) == [1, 2, 4, 8]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    big = graph_sizes(256)
    assert big[:5] == [1, 2, 4, 8, 16] and big[-1] == 256 and len(big) == 35
    assert all(b - a <= 8 for a, b in zip(big, big[1:]))  # at most 7 padding rows
    with pytest.raises(ValueError):
        graph_sizes(0)


def test_block_table_device_copy_follows_the_diff() -> None:
    table = BlockTable(2, 6)
    copy = table.mirror(torch.device("cpu"))
    a, b = table.take_seat(), table.take_seat()
    table.append(a, 0, [5, 7])
    table.append(b, 0, [1])
    table.append(a, 2, [9])
    assert not torch.equal(copy, table.cpu)  # nothing sent before the step's flush
    table.flush()
    assert torch.equal(copy, table.cpu) and copy.data_ptr() != table.cpu.data_ptr()
    table.free_seat(a)
    assert table.take_seat() == a and not table.grew
    table.take_seat()  # a third request on two seats: the table grows, the copy graphs read goes
    assert table.grew and table.device_copy is None and table.cpu.shape == (4, 6)
    assert table.rows[a, :3].tolist() == [5, 7, 9]


SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from conftest import build_model_dir
    from helpers import hf_greedy, random_prompts
    from dolmus import LLM, SamplingParams
    from dolmus.runtime.cuda_graphs import CudaGraphDecoder

    folder = build_model_dir({arch!r}, Path({root!r}))
    prompts = random_prompts(lengths=(1, 5, 17, 33, 9), seed=0)
    # different lengths: the batch shrinks 5 -> 1 as requests end, so steps replay padded sizes
    lengths = [2, 4, 7, 9, 3]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    want = [hf_greedy(folder, p, n) for p, n in zip(prompts, lengths)]

    def tokens(**kw):
        llm = LLM(model=str(folder), dtype="float32", max_num_seqs=6, **kw)
        outs = llm.generate(prompts, params)
        # again, in reverse: seats are reused (their old rows still in the device's block
        # table) and the prompts' blocks come from the prefix cache
        again = llm.generate(prompts[::-1], params[::-1])[::-1]
        runner = llm.engine.executor.runner
        first, second = ([o.outputs[0].token_ids for o in r] for r in (outs, again))
        assert first == second, (first, second)
        return first, runner

    got, runner = tokens(attention_backend="triton")
    graphs = runner.fused_decoder
    assert isinstance(graphs, CudaGraphDecoder), graphs
    # a replay per decode step (8 per generate): 5 rows (padded to 6), 4, 3 (padded to 4), 2, 1
    assert graphs.sizes == [1, 2, 4, 6] and graphs.replays == 16, (graphs.sizes, graphs.replays)
    # a real graph holds raw addresses: every tensor made for its metadata before capture must
    # stay referenced by the decoder (a freed one was an illegal memory access on the GPU)
    import gc, weakref
    qsl = {{s: weakref.ref(c.meta.query_start_loc) for s, c in graphs._graphs.items()}}
    gc.collect()
    assert all(ref() is not None for ref in qsl.values())
    # the spare block padding rows write to is past every block the engine hands out
    assert runner.kv_caches[0].data.shape[1] == (runner.num_blocks + 1) * runner.block_size
    assert got == want, (got, want)
    if not {every_mode}:  # the modes below are the same code whatever the architecture
        print("ok")
        sys.exit(0)
    # async scheduling: decode inputs read the last step's tokens on the device, in the graph
    ahead, runner = tokens(attention_backend="triton", async_scheduling=True)
    assert runner.fused_decoder.last_sampled is runner.inflight.device_buffer
    assert runner.fused_decoder.replays >= 16 and ahead == want, (ahead, want)
    eager, runner = tokens(attention_backend="triton", enforce_eager=True)
    assert runner.fused_decoder is None and eager == want
    # a quantized cache read in the kernel with its scales: the same tokens as the torch backend
    q8, _ = tokens(attention_backend="triton", kv_cache_dtype="int8")
    ref8, _ = tokens(attention_backend="torch", kv_cache_dtype="int8")
    assert q8 == ref8, (q8, ref8)
    print("ok")
    """
)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_triton_backend_and_graphs_match_transformers(arch: str, tmp_path: Path) -> None:
    """qwen2 (one KV head) through every mode (async scheduling, eager, an int8 cache); mistral
    (grouped KV heads, linear rope scaling) through graphs alone: under the interpreter each
    mode costs it ~10 s, and the modes' code does not depend on the architecture."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "DOLMUS_EMULATE_CUDA_GRAPHS": "1"}
    script = SCRIPT.format(tests=str(TESTS), arch=arch, root=str(tmp_path), every_mode=arch == "qwen2")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
