"""The peers as registry entries (ops/reshape_and_cache_flash/peers): FlashInfer's slot conversion
against its documented page-table semantics, vLLM's argument mapping with fake modules that
record the call, torch.compile on the CPU, and the benchmark checking a peer before timing it."""

from __future__ import annotations

import json
import random
import types

import pytest
import torch

from kvwrite import registry
from kvwrite.bench.check import check_point
from kvwrite.bench.cli import main
from kvwrite.bench.workload import fill_caches, make_caches, make_input_sets
from kvwrite.dtypes import CacheDType
from kvwrite.ops.reshape_and_cache_flash import OP
from kvwrite.ops.reshape_and_cache_flash.peers import flashinfer as fi
from kvwrite.ops.reshape_and_cache_flash.peers import vllm_cuda, vllm_triton
from kvwrite.testing import Case
from kvwrite.testing.slots import SlotPattern, make_slots

PEERS = ("torch-compile", "vllm", "vllm-triton", "flashinfer")


def test_peers_are_registered_below_kvwrites_own():
    own = min(registry.get(OP, n).priority for n in ("torch", "triton", "cuda"))
    for name in PEERS:
        assert registry.get(OP, name).priority < own
    assert not registry.get(OP, "torch-compile").graph_safe


# --- FlashInfer: the documented semantics, restated ----------------------------------------------

def flashinfer_destinations(args: dict, page_size: int) -> list[tuple[int, int]]:
    """Where FlashInfer's docs put token i: request b = batch_indices[i] at position p =
    positions[i] lands in page kv_indices[kv_indptr[b] + p // page_size], entry p % page_size."""
    out = []
    for b, p in zip(args["batch_indices"].tolist(), args["positions"].tolist(), strict=True):
        page = args["kv_indices"][args["kv_indptr"][b] + p // page_size]
        out.append((int(page), p % page_size))
    return out


def _documented_seq_lens(args: dict, page_size: int) -> list[int]:
    """FlashInfer's get_seq_lens: (pages - 1) * page_size + last_page_len, per request."""
    indptr, last = args["kv_indptr"].tolist(), args["kv_last_page_len"].tolist()
    return [(indptr[b + 1] - indptr[b] - 1) * page_size + last[b] for b in range(len(last))]


@pytest.mark.parametrize("block_size", [16, 32])
def test_one_request_conversion_puts_each_row_in_its_slot(block_size):
    random.seed(1)
    slots = torch.tensor(random.sample(range(40 * block_size), 50))
    args = fi.one_request(slots, 40, block_size)
    assert flashinfer_destinations(args, block_size) == [divmod(s, block_size) for s in slots.tolist()]
    assert _documented_seq_lens(args, block_size) == [40 * block_size]
    assert all(t.dtype == torch.int32 for t in args.values())


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_per_sequence_conversion_agrees_with_the_slots(kind):
    batch = make_slots(SlotPattern(kind, prefill_len=40, context_len=90), 64, 512, 16)
    args = fi.per_sequence(batch.sequences, 16)
    assert flashinfer_destinations(args, 16) == [divmod(int(s), 16) for s in batch.slots]
    # Each request's length, as FlashInfer reads its page table, ends at its last new token.
    assert _documented_seq_lens(args, 16) == [s.start + s.num_new for s in batch.sequences]


class FakeFlashInferPage(types.ModuleType):
    """flashinfer.page with append_paged_kv_cache doing what its docs say, one row at a time."""

    def __init__(self):
        super().__init__("flashinfer.page")
        self.calls = []

    def append_paged_kv_cache(self, append_key, append_value, batch_indices, positions,
                              paged_kv_cache, kv_indices, kv_indptr, kv_last_page_len,
                              kv_layout="NHD"):
        self.calls.append(kv_layout)
        k_cache, v_cache = paged_kv_cache
        page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
        args = dict(batch_indices=batch_indices, positions=positions, kv_indices=kv_indices,
                    kv_indptr=kv_indptr)
        for i, (page, entry) in enumerate(flashinfer_destinations(args, page_size)):
            for cache, src in ((k_cache, append_key), (v_cache, append_value)):
                if kv_layout == "NHD":
                    cache[page, entry] = src[i]
                else:
                    cache[page, :, entry] = src[i]


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fake = FakeFlashInferPage()
    monkeypatch.setattr(fi, "_load", lambda: (fake, None))
    monkeypatch.setattr(fi, "available", lambda device: None)
    return fake


def _point(layout: str, kind: str = "decode", pad: float = 0.0, num_tokens: int = 40):
    case = Case.named_layout(layout, num_tokens=0, num_heads=2, head_size=64, num_blocks=96,
                             slots=SlotPattern(kind, pad_fraction=pad, prefill_len=24))
    caches = make_caches(case, torch.device("cpu"))
    fill_caches(*caches, case)
    (inp,) = make_input_sets(case, num_tokens, 1, torch.device("cpu"))
    return case, caches, inp


@pytest.mark.parametrize("layout", ["NHD", "HND", "packed"])
@pytest.mark.parametrize("kind", ["random", "prefill"])
def test_flashinfer_adapter_passes_the_check(fake_flashinfer, layout, kind):
    case, caches, inp = _point(layout, kind)
    args = inp.run_args(*caches, case.cache_dtype)
    assert fi.prepare(*args) is None
    assert check_point(fi.run, *caches, inp, case) is None
    assert fake_flashinfer.calls == [layout if layout != "packed" else "NHD"]


def test_flashinfer_refuses_padding_before_writing(fake_flashinfer):
    case, caches, inp = _point("NHD", pad=0.25)
    args = inp.run_args(*caches, case.cache_dtype)
    assert "no padding" in fi.prepare(*args)
    with pytest.raises(ValueError, match="no padding"):
        fi.run(*args)
    assert fake_flashinfer.calls == []


def test_flashinfer_converts_once_per_slot_tensor(fake_flashinfer, monkeypatch):
    case, caches, inp = _point("NHD")
    args = inp.run_args(*caches, case.cache_dtype)
    fi.prepare(*args)
    conversions = []
    monkeypatch.setattr(fi, "one_request", lambda *a: conversions.append(a))
    for _ in range(3):
        fi.run(*args)
    assert conversions == [] and len(fake_flashinfer.calls) == 3
    inp.slot_mapping.add_(0)  # an in-place change invalidates the conversion
    with pytest.raises(TypeError):
        fi.run(*args)  # the monkeypatched converter returned None: it was called again
    assert len(conversions) == 1


@pytest.mark.parametrize("kw,words", [
    (dict(kv="fp8"), "without conversion or scaling"),
    (dict(kv="float16"), "without conversion or scaling"),
    (dict(dtype=torch.float32), "float16 or bfloat16"),
    (dict(d=80), "head sizes"),
    (dict(h=128, d=128), "16 x 128 threads"),
])
def test_flashinfer_says_what_it_cannot_run(kw, words):
    h, d = kw.get("h", 8), kw.get("d", 128)
    key = torch.zeros(1, h, d, dtype=kw.get("dtype", torch.bfloat16))
    cache = torch.zeros(4, 16, h, d, dtype=key.dtype)
    cache_dtype = CacheDType(kw.get("kv", "auto")) if kw.get("kv") != "fp8" else CacheDType.FP8_E4M3
    assert words in fi.unsupported(key, cache, cache_dtype, None, None)
    assert fi.unsupported(torch.zeros(1, 8, 128, dtype=torch.bfloat16),
                          torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16), CacheDType.AUTO,
                          None, None) is None


def test_benchmark_checks_a_peer_and_reports_padding(fake_flashinfer, tmp_path, capsys):
    js = tmp_path / "r.json"
    base = ["--device", "cpu", "--num-blocks", "64", "--num-heads", "2", "--head-size", "64",
            "--num-tokens", "4,16", "--iters", "3", "--implementation", "torch,flashinfer",
            "--json", str(js)]
    assert main([*base, "--slots", "prefill", "--prefill-len", "8"]) == 0
    rows = json.loads(js.read_text())["rows"]
    peer = [r for r in rows if r["implementation"] == "flashinfer"]
    assert len(peer) == 4 and all(r["check"] == "passed" and r["status"] == "ok" for r in peer)
    assert "flashinfer vs torch" in capsys.readouterr().out
    assert main([*base, "--slots", "decode", "--pad-fraction", "0.5"]) == 0
    rows = json.loads(js.read_text())["rows"]
    peer = [r for r in rows if r["implementation"] == "flashinfer"]
    assert all(r["status"].startswith("unsupported: FlashInfer's append_paged_kv_cache has no "
                                      "padding") for r in peer)


# --- vLLM: argument mapping with fake modules that record the call -------------------------------

def _recorder(calls):
    def fn(*args):
        calls.append(args)
    return fn


@pytest.mark.parametrize("mod", [vllm_cuda, vllm_triton])
def test_vllm_adapters_pass_vllms_arguments(monkeypatch, mod):
    calls = []
    monkeypatch.setattr(mod, "_load", lambda: (_recorder(calls), None))
    key = torch.randn(5, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.uint8)
    slots = torch.arange(5)
    scale = torch.tensor([0.5])
    mod.run(key, key, cache, cache, slots, CacheDType.FP8_E4M3, scale, scale)
    mod.run(key, key, cache.view(torch.bfloat16)[..., :64], cache, slots, CacheDType.AUTO, None, None)
    mod.run(key, key, cache, cache, slots, CacheDType.BFLOAT16, None, None)
    (k, v, kc, vc, s, kv, ks, vs), auto, same = calls
    assert k is key and kc is cache and s is slots and kv == "fp8_e4m3" and ks is scale
    assert auto[5] == "auto" and auto[6].tolist() == [1.0]  # vLLM takes scale tensors always
    assert same[5] == "auto"  # a "cast" to the input's own dtype is vLLM's copy


@pytest.mark.parametrize("mod", [vllm_cuda, vllm_triton])
def test_vllm_adapters_say_what_they_cannot_run(mod):
    key = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    nhd = torch.zeros(8, 16, 4, 64, dtype=torch.uint8)
    one, four = torch.ones(1), torch.ones(4)
    assert "no vLLM spelling" in mod.unsupported(key, nhd, CacheDType.FLOAT16, None, None)
    # Each scale's kind is its own: a per-head value scale is refused beside a per-tensor key one.
    assert "k_scale: 4" in mod.unsupported(key, nhd, CacheDType.FP8_E4M3, four, one)
    assert "v_scale: 4" in mod.unsupported(key, nhd, CacheDType.FP8_E4M3, one, four)
    assert "per-head" in mod.unsupported(key, nhd, CacheDType.FP8_E4M3, four, four)
    assert mod.unsupported(key, nhd, CacheDType.FP8_E4M3, one, one) is None
    hnd = torch.zeros(8, 4, 16, 64, dtype=torch.uint8).transpose(1, 2)
    e5m2 = mod.unsupported(key, nhd, CacheDType.FP8_E5M2, one, one)
    if mod is vllm_triton:
        assert "HND or packed" in mod.unsupported(key, hnd, CacheDType.AUTO, None, None)
        assert "e4m3 bits" in e5m2
    else:
        assert mod.unsupported(key, hnd, CacheDType.AUTO, None, None) is None
        assert e5m2 is None


@pytest.mark.parametrize("mod", [vllm_cuda, vllm_triton])
def test_vllm_adapters_are_not_offered_without_vllm(mod):
    mod._load.cache_clear()
    try:
        reason = mod.available(torch.device("cuda"))
        try:
            import vllm  # noqa: F401
        except Exception:
            assert reason is not None and "vllm is not installed" in reason
        assert "CUDA" in mod.available(torch.device("cpu"))
    finally:
        mod._load.cache_clear()


# --- torch.compile ------------------------------------------------------------------------------

def test_torch_compile_passes_the_check_on_cpu():
    info = registry.get(OP, "torch-compile")
    reason = info.available("cpu")
    if reason is not None:
        pytest.skip(reason)
    case, caches, inp = _point("HND", "mixed", pad=0.25, num_tokens=16)
    assert check_point(info.run, *caches, inp, case) is None


def test_torch_compile_refuses_views_of_a_larger_allocation_on_cuda():
    """AOTAutograd cannot mutate two views of one allocation: a K|V-interleaved key cache is not
    offered on CUDA (it raised there), a whole or permuted allocation is."""
    from kvwrite.validation import spans_its_storage

    kv = torch.zeros(4, 16, 2, 8, 64)
    assert not spans_its_storage(kv[:, :, 0])
    assert not spans_its_storage(kv[:, :, 1])
    assert spans_its_storage(kv)
    assert spans_its_storage(torch.zeros(4, 8, 16, 64).transpose(1, 2))
    assert not spans_its_storage(torch.zeros(4, 8, 16, 64)[1:])
    assert spans_its_storage(torch.zeros(0, 16, 8, 64))


def test_flashinfer_writes_nothing_for_zero_tokens(fake_flashinfer):
    case, caches, inp = _point("NHD")
    empty = inp.slot_mapping[:0]
    fi.run(inp.key, inp.value, *caches, empty, case.cache_dtype, None, None)
    assert fake_flashinfer.calls == []
