"""Tensor-parallel linear layers: each rank's layer, built from the full checkpoint tensors,
holds its slice; concatenated column outputs and summed row outputs give the full layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import build_model_dir

from dolmus.config import ModelConfig
from dolmus.distributed.collectives import tensor_parallel_all_reduce
from dolmus.distributed.parallel_config import SINGLE_RANK, ParallelConfig
from dolmus.quant.checkpoint import Int4Codes
from dolmus.quant.prequantized import PrequantizedMethod
from dolmus.quant.weight_only import Int4WeightOnlyMethod, Int8WeightOnlyMethod
from dolmus.runtime.layers.embedding import VocabParallelEmbedding
from dolmus.runtime.layers.linear import Linear, ParallelStyle
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.unquantized import UnquantizedLinearMethod
from dolmus.runtime.loader import iter_weights, safetensors_files
from dolmus.runtime.models.llama import LlamaForCausalLM

COLUMN, ROW = ParallelStyle.COLUMN, ParallelStyle.ROW
QKV = {"q": 16, "k": 8, "v": 8}


def _checkpoint(in_features: int, sizes: dict, bias: bool, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        shard: (
            torch.randn(size, in_features, generator=gen),
            torch.randn(size, generator=gen) if bias else None,
        )
        for shard, size in sizes.items()
    }


def _layer(
    checkpoint: dict,
    in_features: int,
    style: ParallelStyle = ParallelStyle.REPLICATED,
    parallel: ParallelConfig = SINGLE_RANK,
    method: LinearMethod | None = None,
) -> Linear:
    sizes = {shard: w.shape[0] for shard, (w, _) in checkpoint.items()}
    bias = next(iter(checkpoint.values()))[1] is not None
    method = method or UnquantizedLinearMethod(prepack=False)
    layer = Linear(in_features, sizes, bias, torch.float32, method, style=style, parallel=parallel)
    for shard, (w, b) in checkpoint.items():
        layer.weight_loader(layer.weight, w, shard)
        if b is not None:
            layer.weight_loader(layer.bias, b, shard)
    layer.process_weights_after_loading()
    return layer


def _ranks(checkpoint: dict, in_features: int, style: ParallelStyle, tp: int = 2, **kw) -> list[Linear]:
    return [_layer(checkpoint, in_features, style, ParallelConfig(r, tp), **kw) for r in range(tp)]


def _gather_columns(outputs: list[torch.Tensor], layers: list[Linear]) -> torch.Tensor:
    """Rank outputs [q_r, k_r, v_r] back into the full layer's [q, k, v] order."""
    parts = []
    for shard in layers[0].shard_offsets:
        for y, layer in zip(outputs, layers):
            start, size = layer.shard_offsets[shard]
            parts.append(y[:, start : start + size])
    return torch.cat(parts, dim=-1)


X = torch.randn(5, 24, generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("sizes", [QKV, {None: 12}], ids=["fused-qkv", "plain"])
@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_outputs_concatenate_to_the_full_layer(sizes: dict, tp: int) -> None:
    checkpoint = _checkpoint(24, sizes, bias=True)
    full, ranks = _layer(checkpoint, 24), _ranks(checkpoint, 24, COLUMN, tp)
    assert [r.out_features for r in ranks] == [full.out_features // tp] * tp
    assert all(r.in_features == 24 for r in ranks)
    torch.testing.assert_close(_gather_columns([r(X) for r in ranks], ranks), full(X))


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_outputs_sum_to_the_full_layer(tp: int) -> None:
    checkpoint = _checkpoint(24, {None: 12}, bias=True)
    full, ranks = _layer(checkpoint, 24), _ranks(checkpoint, 24, ROW, tp)
    slices = X.chunk(tp, dim=-1)  # each rank sees its share of the inputs
    assert all(r.in_features == 24 // tp and r.out_features == 12 for r in ranks)
    torch.testing.assert_close(sum(r(x) for r, x in zip(ranks, slices)), full(X))  # bias added once


def test_a_column_then_row_mlp_sums_to_the_full_mlp() -> None:
    """gate/up column-parallel, down row-parallel: one all-reduce per MLP, as in the model."""
    gate_up, down = _checkpoint(24, {"gate": 16, "up": 16}, bias=False), _checkpoint(16, {None: 24}, False, 1)

    def mlp(up: Linear, dn: Linear) -> torch.Tensor:
        g, u = up(X).chunk(2, dim=-1)
        return dn(F.silu(g) * u)

    ranks = zip(_ranks(gate_up, 24, COLUMN), _ranks(down, 16, ROW))
    torch.testing.assert_close(sum(mlp(u, d) for u, d in ranks), mlp(_layer(gate_up, 24), _layer(down, 16)))


@pytest.mark.parametrize("style", [COLUMN, ROW])
def test_one_rank_is_the_plain_layer_bit_for_bit(style: ParallelStyle) -> None:
    checkpoint = _checkpoint(24, QKV if style is COLUMN else {None: 12}, bias=True)
    plain, single = _layer(checkpoint, 24), _layer(checkpoint, 24, style, ParallelConfig(0, 1))
    assert torch.equal(single.weight, plain.weight) and torch.equal(single.bias, plain.bias)
    assert torch.equal(single(X), plain(X))
    assert tensor_parallel_all_reduce(X, ParallelConfig(0, 1)) is X


def test_quantized_ranks_hold_slices_of_the_full_layers_codes() -> None:
    """Per-row int8 scales survive a column split; int4 groups survive a row split of whole groups."""
    checkpoint = _checkpoint(64, {None: 32}, bias=False)
    full8 = _layer(checkpoint, 64, method=Int8WeightOnlyMethod())
    ranks8 = _ranks(checkpoint, 64, COLUMN, method=Int8WeightOnlyMethod())
    deq = torch.cat([r.method.dequantize(r) for r in ranks8])
    assert torch.equal(deq, full8.method.dequantize(full8))
    full4 = _layer(checkpoint, 64, method=Int4WeightOnlyMethod(32))
    ranks4 = _ranks(checkpoint, 64, ROW, method=Int4WeightOnlyMethod(32))
    deq = torch.cat([r.method.dequantize(r) for r in ranks4], dim=1)
    assert torch.equal(deq, full4.method.dequantize(full4))


def test_checkpoint_codes_narrow_like_the_weight_they_stand_for() -> None:
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8)
    zeros, scale = torch.randint(0, 16, (8, 4), generator=gen).float(), torch.rand(8, 4, generator=gen)
    plain = Int4Codes(codes, zeros, scale, 16)
    scattered = Int4Codes(codes, zeros, scale, 16, torch.randint(0, 4, (64,), generator=gen))
    for stored in (plain, scattered):
        w = stored.dequantize()
        assert torch.equal(stored.narrow(0, 4, 4).dequantize(), w[4:])
        assert torch.equal(stored.narrow(1, 32, 32).dequantize(), w[:, 32:])
    with pytest.raises(ValueError, match="cut its groups"):
        plain.narrow(1, 8, 32)
    # A pre-quantized layer's ranks take their codes' slices (here dequantized: fp32 has no int4 kernel).
    ranks = []
    for rank in range(2):
        method = PrequantizedMethod(UnquantizedLinearMethod(prepack=False))
        layer = Linear(64, 8, False, torch.float32, method, style=ROW, parallel=ParallelConfig(rank, 2))
        layer.weight_loader(layer.weight, plain)
        layer.process_weights_after_loading()
        assert layer.checkpoint_layout == "dequantized" and isinstance(layer.method, UnquantizedLinearMethod)
        ranks.append(layer.weight)
    assert torch.equal(torch.cat(ranks, dim=1), plain.dequantize())


def test_shapes_that_do_not_split_or_fit_are_clear_errors() -> None:
    def build(sizes: dict | int, style: ParallelStyle, rank: int, tp: int) -> Linear:
        method = UnquantizedLinearMethod()
        return Linear(24, sizes, False, torch.float32, method, style=style, parallel=ParallelConfig(rank, tp))

    with pytest.raises(ValueError, match=r"output features of part 'k' \(8\) does not split evenly"):
        build({"q": 24, "k": 8}, COLUMN, 0, 3)
    with pytest.raises(ValueError, match=r"input features \(24\) does not split evenly over tp_size 5"):
        build(8, ROW, 0, 5)
    layer = build(8, ROW, 1, 2)
    with pytest.raises(ValueError, match=r"weight shape \(8, 12\) does not fit \(8, 24\)"):
        layer.weight_loader(layer.weight, torch.zeros(8, 12))  # a rank's slice is not a checkpoint
    for rank, size in ((2, 2), (0, 0)):
        with pytest.raises(ValueError, match="tp_"):
            ParallelConfig(rank, size)


def test_a_model_rank_holds_its_heads_and_loads_the_full_checkpoint(model_root) -> None:
    folder = build_model_dir("llama", model_root)  # 4 heads, 2 KV heads, 128 inner features
    cfg = ModelConfig.from_dir(folder)
    for rank in range(2):
        # attention is not run here: the backend is not needed
        model = LlamaForCausalLM(
            cfg, torch.float32, UnquantizedLinearMethod(), None, 64, ParallelConfig(rank, 2)
        )
        model.load_weights(iter_weights(safetensors_files(folder)))  # no weight missing or misfit
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert (attn.num_heads, attn.num_kv_heads, mlp.size) == (2, 1, 64)
        assert attn.qkv_proj.shard_offsets == {"q": (0, 32), "k": (32, 16), "v": (48, 16)}
        assert (attn.o_proj.in_features, mlp.down_proj.in_features) == (32, 64)
        assert model.lm_head.out_features == model.model.embed_tokens.weight.shape[0] == cfg.vocab_size // 2


def test_fewer_kv_heads_than_ranks_are_shared_by_the_ranks(model_root) -> None:
    """Qwen2 fixture: one KV head, four query heads. Each of 2 or 4 ranks holds the KV head whole."""
    folder = build_model_dir("qwen2", model_root)
    cfg = ModelConfig.from_dir(folder)
    state = dict(iter_weights(safetensors_files(folder)))
    k_full = state["model.layers.0.self_attn.k_proj.weight"]
    for tp in (2, 4):
        for rank in range(tp):
            model = LlamaForCausalLM(
                cfg, torch.float32, UnquantizedLinearMethod(), None, 64, ParallelConfig(rank, tp)
            )
            model.load_weights(state.items())
            attn = model.model.layers[0].self_attn
            assert (attn.num_heads, attn.num_kv_heads) == (4 // tp, 1)
            start, size = attn.qkv_proj.shard_offsets["k"]
            assert torch.equal(attn.qkv_proj.weight[start : start + size], k_full)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) neither splits over nor divides"):
        ParallelConfig(0, 3).kv_heads(2)


@pytest.mark.parametrize("vocab,tp", [(12, 2), (10, 4)], ids=["even", "padded"])
def test_vocab_parallel_embedding_and_head_reproduce_the_whole_ones(vocab: int, tp: int) -> None:
    """Embedding rows and head outputs split by vocabulary; an uneven split pads the last rank
    with zero rows that the gathered logits drop."""
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(vocab, 24, generator=gen)
    ids = torch.tensor([0, 3, vocab - 1, 5, 9])
    embeddings, logits = [], []
    for rank in range(tp):
        parallel = ParallelConfig(rank, tp)
        emb = VocabParallelEmbedding(vocab, 24, torch.float32, parallel)
        emb.weight_loader(emb.weight, table)
        embeddings.append(emb(ids))  # this rank's rows, zeros elsewhere (all-reduced in a group)
        head = Linear(
            24, parallel.vocab(vocab), False, torch.float32, UnquantizedLinearMethod(prepack=False),
            style=COLUMN, parallel=parallel, gather_output=True,
        )
        head.weight_loader(head.weight, table)
        head.process_weights_after_loading()
        logits.append(head(X))  # this rank's columns (all-gathered in a group)
    torch.testing.assert_close(sum(embeddings), table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], X @ table.T)
    assert torch.count_nonzero(torch.cat(logits, dim=-1)[:, vocab:]) == 0


def test_padding_codes_is_a_clear_error() -> None:
    codes = Int4Codes(torch.zeros(10, 64, dtype=torch.uint8), torch.zeros(10, 4), torch.ones(10, 4), 16)
    method = PrequantizedMethod(UnquantizedLinearMethod(prepack=False))
    parallel = ParallelConfig(3, 4)
    head = Linear(64, parallel.vocab(10), False, torch.float32, method, style=COLUMN, parallel=parallel)
    with pytest.raises(ValueError, match="do not split evenly over the tensor-parallel ranks"):
        head.weight_loader(head.weight, codes)


def _all_reduce_worker(rank: int, init_file: str, checkpoint: dict, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        layer = _layer(checkpoint, 24, ROW, ParallelConfig(rank, 2))
        out[rank] = layer(X.chunk(2, dim=-1)[rank]).clone()
    finally:
        dist.destroy_process_group()


def test_row_parallel_layers_all_reduce_across_a_process_group(tmp_path) -> None:
    import torch.multiprocessing as mp

    checkpoint = _checkpoint(24, {None: 12}, bias=True)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_all_reduce_worker, args=(str(tmp_path / "rendezvous"), checkpoint, out), nprocs=2)
        results = dict(out)
    expected = _layer(checkpoint, 24)(X)
    for rank in range(2):  # every rank ends with the full output
        torch.testing.assert_close(results[rank], expected)


def _all_gather_worker(rank: int, init_file: str, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        parallel = ParallelConfig(rank, 2)
        table = torch.randn(10, 24, generator=torch.Generator().manual_seed(4))
        head = Linear(
            24, parallel.vocab(10), False, torch.float32, UnquantizedLinearMethod(prepack=False),
            style=COLUMN, parallel=parallel, gather_output=True,
        )
        head.weight_loader(head.weight, table)
        emb = VocabParallelEmbedding(10, 24, torch.float32, parallel)
        emb.weight_loader(emb.weight, table)
        out[rank] = (head(X).clone(), emb(torch.tensor([1, 7, 9])).clone())
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_layers_gather_and_reduce_across_a_process_group(tmp_path) -> None:
    import torch.multiprocessing as mp

    table = torch.randn(10, 24, generator=torch.Generator().manual_seed(4))
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_all_gather_worker, args=(str(tmp_path / "rendezvous"), out), nprocs=2)
        results = dict(out)
    for rank in range(2):  # every rank ends with the whole logits and embeddings
        torch.testing.assert_close(results[rank][0], X @ table.T)
        torch.testing.assert_close(results[rank][1], table[[1, 7, 9]])


def _shm_worker(rank: int, init_file: str, out: dict) -> None:
    import torch.distributed as dist

    from dolmus.distributed.collectives import (
        tensor_parallel_all_gather,
        tensor_parallel_all_reduce,
        use_shared_memory,
    )
    from dolmus.distributed.shm_collectives import ShmCollectives

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        shm = ShmCollectives(rank, 2, timeout_s=2, slot_bytes=4096)
        use_shared_memory(shm)
        parallel = ParallelConfig(rank, 2)
        results = []
        for step in range(5):  # both buffers, reused: no step may read the previous one's data
            x = torch.full((3, 8), float(rank + 1 + step), dtype=torch.bfloat16)
            results.append(tensor_parallel_all_reduce(x, parallel).clone())
        results.append(tensor_parallel_all_gather(torch.full((2, 3), float(rank)), parallel))
        big = torch.full((2048,), float(rank + 1))  # 8 KB: over the slot, through gloo
        results.append(tensor_parallel_all_reduce(big, parallel).clone())
        if rank == 0:  # rank 1 never comes to this one
            try:
                shm.all_reduce(torch.ones(4))
            except TimeoutError as exc:
                results.append(str(exc))
        out[rank] = results
        use_shared_memory(None)
    finally:
        dist.destroy_process_group()


def test_shared_memory_collectives_sum_and_gather_like_gloo(tmp_path) -> None:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_shm_worker, args=(str(tmp_path / "rendezvous"), out), nprocs=2)
        results = dict(out)
    for rank in range(2):
        reduced = results[rank][:5]
        for step, got in enumerate(reduced):
            assert torch.equal(got, torch.full((3, 8), float(3 + 2 * step), dtype=torch.bfloat16))
        assert torch.equal(results[rank][5], torch.tensor([[0.0, 0, 0, 1, 1, 1]] * 2))
        assert torch.equal(results[rank][6], torch.full((2048,), 3.0))
    assert "ranks [1] did not arrive in 2 s" in results[0][7]
    assert not list(Path("/dev/shm").glob("dolmus-tp-*"))  # the mapping's name is gone
