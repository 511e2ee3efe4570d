"""The benchmark's layout names: vLLM's two default per-layer orders (LBNHC = "packed", LBHNC =
"HND-packed") next to NHD and HND, allocated with vLLM's strides, accepted by every benchmark that
can write them and refused in one line by those that cannot; qk-norm-rope's defaults (issue #42).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvwrite.bench import engine
from kvwrite.bench.cli import main
from kvwrite.bench.ops import fused_qk_norm_rope_and_reshape_cache_flash as qk_bench
from kvwrite.layouts import (
    LAYOUT_NAMES,
    KVAlloc,
    Layout,
    allocate_kv_cache,
    layout_alloc,
    parse_layout_names,
)
from kvwrite.testing import Case

NB, BS, H, D = 5, 16, 3, 8

# name, vLLM's KVCacheLayout name, its physical order, the permutation to vLLM's logical
# (num_blocks, H, block_size, 2*D) cache.
VLLM_ORDERS = [("packed", "LBNHC", (NB, BS, H, 2 * D), (0, 2, 1, 3)),
               ("HND-packed", "LBHNC", (NB, H, BS, 2 * D), (0, 1, 2, 3))]


@pytest.mark.parametrize("name, alias, physical, perm", VLLM_ORDERS)
def test_packed_names_allocate_vllms_per_layer_cache(name, alias, physical, perm):
    """vLLM's callers pass ``kv.transpose(1, 2).split(D, -1)`` of its per-layer cache; the
    benchmark's allocation of that name has the same shape, strides and K-to-V offset, in one
    allocation of the same size."""
    kv = torch.empty(physical, dtype=torch.bfloat16).permute(*perm)
    assert kv.shape == (NB, H, BS, 2 * D)
    vk, vv = kv.transpose(1, 2).split(D, -1)
    assert layout_alloc(alias) == layout_alloc(name)
    k, v = allocate_kv_cache(NB, BS, H, D, torch.bfloat16, *layout_alloc(name), device="cpu")
    for ours, theirs in ((k, vk), (v, vv)):
        assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
    assert v.storage_offset() - k.storage_offset() == vv.storage_offset() - vk.storage_offset()
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.untyped_storage().nbytes() == kv.untyped_storage().nbytes()
    case = Case.named_layout(alias)
    assert case.layout_name == name and case.alloc is KVAlloc.PACKED


def test_layout_names_and_aliases():
    assert LAYOUT_NAMES == ("NHD", "HND", "packed", "HND-packed")
    assert layout_alloc("HND-packed") == (Layout.HND, KVAlloc.PACKED)
    assert layout_alloc("packed") == layout_alloc("NHD-packed") == (Layout.NHD, KVAlloc.PACKED)
    assert parse_layout_names("LBHNC,all,LBNHC", "--layouts") == [
        "HND-packed", "NHD", "HND", "packed"]
    assert parse_layout_names("all", "--layouts", ("NHD", "HND")) == ["NHD", "HND"]
    with pytest.raises(ValueError, match="kv_cache_layout: expected one of NHD, HND, packed, "
                                         "HND-packed"):
        from kvwrite.bench import run_benchmark
        run_benchmark(2, 2, 64, 16, 4, torch.float32, "auto", "XYZ", 2, "torch", "no_graph",
                      device="cpu")


# subcommand, --layouts, what the one line must say besides the flag: the names it takes (the
# packed orders where the op writes them) or what the op writes instead.
BAD = [
    ("reshape_and_cache_flash", "NHD,XYZ", "HND-packed (or LBNHC, NHD-packed, LBHNC) or all"),
    ("reshape_and_cache_flash", "NHD,", "without empty items"),
    ("rope", "packed,XYZ", "HND-packed"), ("qk-norm-rope", "LBHNC,bogus", "unknown 'bogus'"),
    ("per-token-head", "packed", "--kv-alloc packed"), ("per-token-head", "LBHNC", "--kv-alloc"),
    ("nvfp4", "HND-packed", "no packed NVFP4 cache"), ("nvfp4", "LBNHC", "no packed NVFP4"),
]


@pytest.mark.parametrize("sub, layouts, says", BAD)
def test_a_layout_an_op_cannot_write_is_one_line_and_exit_2(no_bench_work, capsys, sub, layouts,
                                                            says):
    with pytest.raises(SystemExit) as e:
        main([sub, "--device", "cpu", "--num-tokens", "1", "--layouts", layouts])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--layouts" in lines[0] and says in lines[0], lines


# Each benchmark that writes the packed orders, with the torch reference and Triton (its
# interpreter on the CPU, float32 into float32 caches: exact there): every point checked against the reference's
# bytes before it is timed.
WRITERS = [
    ["reshape_and_cache_flash", "--num-heads", "4", "--dtype", "float", "--num-tokens", "2,16"],
    ["rope", "--heads", "4,2,32", "--dtypes", "float32", "--kv-cache-dtypes", "auto",
     "--num-tokens", "3"],
    ["qk-norm-rope", "--heads", "4,2,32", "--dtype", "float32", "--kv-cache-dtypes",
     "auto", "--num-tokens", "3"],
]


@pytest.mark.parametrize("argv", WRITERS, ids=lambda a: a[0])
def test_benchmarks_write_both_vllm_orders_exactly(tmp_path, argv):
    path = tmp_path / "r.json"
    rc = main([*argv, "--device", "cpu", "--layouts", "LBNHC,LBHNC", "--implementation",
               "torch,triton", "--iters", "2", "--time-budget", "0.01", "--json", str(path)])
    assert rc == 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["layout"] for r in rows} == {"packed", "HND-packed"}
    assert {r["implementation"] for r in rows} == {"torch", "triton"}
    for r in rows:
        assert r["status"] == "ok" and r["check"] != "failed", r
        assert r["implementation"] == "torch" or r["check"] == "passed", r


def test_qk_norm_rope_defaults_cover_issue_42():
    """Qwen3-8B, bf16 qkv, a bf16 [40960, 128] table, max(256, 2T/16) blocks of 16, random
    slots, auto and fp8_e4m3, the fused call and the pair, NHD and both vLLM orders."""
    cfg, args, points, _ = engine.configure(qk_bench.BENCH, [], "kvwrite-bench qk-norm-rope")
    assert {"fused", "pair"} <= set(cfg.kinds)
    assert {p.layout for p in points} == {"NHD", "packed", "HND-packed"}
    assert {p.cache_dtype.value for p in points} == {"auto", "fp8_e4m3"}
    for p in points:
        assert p.model == "qwen3-8b" and (p.num_q_heads, p.num_heads, p.head_size) == (32, 8, 128)
        assert p.dtype == p.cos_sin_dtype == torch.bfloat16 and p.max_position == 40960
        assert p.block_size == 16 and p.num_blocks == max(256, 2 * math.ceil(p.num_tokens / 16))
        assert p.slots.kind == "random" and not p.slots.pad_fraction
    # An explicit table dtype and size, as before.
    _, _, points, _ = engine.configure(qk_bench.BENCH, ["--cos-sin-dtype", "float32",
                                                        "--max-position", "4096"], "qk")
    assert {(p.cos_sin_dtype, p.max_position) for p in points} == {(torch.float32, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("argv", WRITERS, ids=lambda a: a[0])
def test_gpu_benchmarks_write_both_vllm_orders_exactly(tmp_path, argv):
    """The same on the GPU: cuda and Triton, bf16 and fp8 caches too, every point checked."""
    path = tmp_path / "r.json"
    kv = ["--kv-cache-dtype", "fp8"] if argv[0] == "reshape_and_cache_flash" else []
    for extra in ([], kv or ["--kv-cache-dtypes", "auto,fp8_e4m3"]):
        rc = main([*argv, *extra, "--layouts", "LBNHC,LBHNC", "--implementation", "cuda,triton",
                   "--num-blocks", "512", "--iters", "5", "--time-budget", "0.01",
                   "--json", str(path)])
        assert rc == 0
        rows = json.loads(path.read_text())["rows"]
        assert {r["layout"] for r in rows} == {"packed", "HND-packed"}
        assert all(r["status"] == "ok" and r["check"] == "passed" for r in rows), rows
