"""Copies across two GPUs of one host (docs/ops/transfer.md, "Across two GPUs of a host"):
swap_blocks (both forms), swap_blocks_multi_layer and relayout_kv_cache with the source on one
GPU and the destination on the other, both ways, by every implementation and engine. Each call is
compared byte for byte, over whole allocations (sources, destinations and the mapping), with the
same call on host copies (the torch reference, itself tested against byte oracles in
tests/test_transfer.py). Also: CUDA-graph capture and replay with new mapping values, the errors
with nothing changed, and where the work is enqueued (the destination's current stream, whichever
device is current). The rules without GPUs: tests/test_transfer.py (call_devices)."""

from __future__ import annotations

import re

import pytest
import torch

import kvwrite
from kvwrite import transfer
from kvwrite.kernels import copy_engine
from kvwrite.testing import conformance
from kvwrite.testing.compare import storage_bytes
from kvwrite.testing.transfer import mapping, random_view

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="needs two GPUs of one host (torch.cuda.device_count() < 2)"),
]

# (source GPU, destination GPU): both ways.
DIRECTIONS = [(0, 1), (1, 0)]
IMPLEMENTATIONS = ["torch", "triton", "cuda"]
# Rows of a CPU mapping (ids in range of every tensor, distinct destinations, a repeated source);
# a GPU mapping adds rows the kernels skip (an id < 0, one past a block count).
PAIRS = [[1, 0], [3, 4], [1, 5]]
GPU_PAIRS = [[1, 0], [-1, 2], [3, 4], [2, 99], [1, 5]]
# The same number of rows, other values (a graph's replay reads the mapping anew).
NEW_PAIRS = [[0, 2], [4, 1], [-1, 3], [3, 3], [6, 7]]


@pytest.fixture(autouse=True)
def _peers():
    for a, b in DIRECTIONS:
        if not torch.cuda.can_device_access_peer(b, a):
            pytest.skip(f"peer access between cuda:{a} and cuda:{b} is unavailable")
    transfer.clear_plan_cache()


# --- the cases: host tensors (fixed seeds), placed on the GPUs whole ------------------------------

def _case(name: str):
    """(op, src side, dst side, arguments before the mapping, after it) on the host. Sides are
    views with padding, offsets and permuted dims; relayout's two stride orders (vLLM's LBNHC
    and LBHNC) and a head range into a rank's slice."""
    bf = torch.bfloat16
    if name == "swap":
        src = random_view((7, 4, 2, 8), (80, 16, 8, 1), bf, offset=3, seed=1)
        dst = random_view((6, 4, 2, 8), (64, 1, 32, 4), bf, offset=1, seed=2)
        return kvwrite.swap_blocks, src, dst, (), ()
    if name == "swap-bytes":  # vLLM's form: 96 bytes of each block, whatever the dims
        src = random_view((7, 4, 2, 8), (80, 16, 8, 1), bf, offset=3, seed=3)
        dst = random_view((8, 4, 2, 8), (64, 16, 8, 1), bf, offset=1, seed=4)
        return kvwrite.swap_blocks, src, dst, (96,), ()
    if name == "multi":  # two groups of their own geometry and dtype, one mapping
        src = [random_view((7, 4, 2, 8), (80, 16, 8, 1), bf, offset=3, seed=5),
               random_view((8, 3, 2, 2, 3), (90, 25, 12, 5, 1), torch.float32, seed=6)]
        dst = [random_view((6, 4, 2, 8), (64, 16, 8, 1), bf, offset=1, seed=7),
               random_view((8, 3, 2, 2, 3), (36, 12, 6, 3, 1), torch.float32, seed=8)]
        return kvwrite.swap_blocks_multi_layer, src, dst, (), ()
    if name == "relayout":  # LBNHC -> LBHNC, every head
        src = random_view((7, 3, 4, 16), None, bf, offset=2, seed=9).transpose(1, 2)
        dst = random_view((8, 4, 3, 16), (208, 48, 16, 1), bf, offset=5, seed=10)
        return kvwrite.relayout_kv_cache, src, dst, (), (None,)
    if name == "relayout-heads":  # two layers, full LBHNC -> a rank's LBNHC slice of heads [2, 4)
        src = [random_view((7, 4, 3, 16), None, bf, seed=11 + k) for k in range(2)]
        dst = [random_view((8, 3, 2, 16), None, bf, offset=k, seed=13 + k).transpose(1, 2)
               for k in range(2)]
        return kvwrite.relayout_kv_cache, src, dst, (), ((2, 4),)
    raise AssertionError(name)


CASES = ["swap", "swap-bytes", "multi", "relayout", "relayout-heads"]


def _flat(side) -> list[torch.Tensor]:
    return list(side) if isinstance(side, list) else [side]


def _place(side, device: int):
    """Each view on ``device``: its whole allocation copied there, the same view of it."""
    def one(t):
        raw = storage_bytes(t).to(f"cuda:{device}")
        return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
    return [one(t) for t in side] if isinstance(side, list) else one(side)


def _on_gpus(name: str, src_dev: int, dst_dev: int):
    op, src, dst, pre, post = _case(name)
    src, dst = _place(src, src_dev), _place(dst, dst_dev)
    for d in (src_dev, dst_dev):  # the copies from pageable memory are complete
        torch.cuda.synchronize(d)
    return op, src, dst, pre, post


def _in_range(pairs, name: str) -> list[list[int]]:
    """The rows of a GPU mapping a call copies: ids inside every tensor's block count."""
    _, src, dst, _, _ = _case(name)
    ns = min(t.shape[0] for t in _flat(src))
    nd = min(t.shape[0] for t in _flat(dst))
    return [[i, j] for i, j in pairs if 0 <= i < ns and 0 <= j < nd]


def _expected(name: str, pairs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(every source's, every destination's allocation bytes) after the call on the host."""
    op, src, dst, pre, post = _case(name)
    op(src, dst, *pre, mapping(_in_range(pairs, name)), *post)
    return ([storage_bytes(t).clone() for t in _flat(src)],
            [storage_bytes(t).clone() for t in _flat(dst)])


def _assert_bytes(side, want, what: str) -> None:
    for k, (t, w) in enumerate(zip(_flat(side), want, strict=True)):
        got = storage_bytes(t).cpu()
        diff = torch.nonzero(got != w).flatten()
        assert diff.numel() == 0, (f"{what}[{k}] on {t.device}: {diff.numel()} bytes differ, "
                                   f"first at {diff[:8].tolist()}")


def _sync(*devices: int) -> None:
    for d in devices:
        torch.cuda.synchronize(d)


# --- every op, implementation and engine, both ways -------------------------------------------------

def _engines():
    for engine in ("sm", "ce", "auto"):
        for on in ("cpu", "dst"):
            if engine == "ce" and on == "dst":
                continue  # refused (the copy engines read the mapping on the host): see below
            yield engine, on


@pytest.mark.parametrize("max_ctas", [1, None])
@pytest.mark.parametrize("engine, mapping_on", list(_engines()))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("src_dev, dst_dev", DIRECTIONS)
@pytest.mark.parametrize("name", CASES)
def test_peer_copy_matches_the_host_copy(name, src_dev, dst_dev, implementation, engine,
                                         mapping_on, max_ctas):
    op, src, dst, pre, post = _on_gpus(name, src_dev, dst_dev)
    if mapping_on == "cpu":
        m = mapping(PAIRS, torch.int64)
    else:
        m = mapping(GPU_PAIRS, torch.int32, odd_strides=True, device=f"cuda:{dst_dev}")
    m_before = storage_bytes(m).clone()
    want_src, want_dst = _expected(name, PAIRS if mapping_on == "cpu" else GPU_PAIRS)
    op(src, dst, *pre, m, *post, max_ctas=max_ctas, engine=engine,
       implementation=implementation)
    _sync(src_dev, dst_dev)
    _assert_bytes(dst, want_dst, "dst")
    _assert_bytes(src, want_src, "src")
    assert torch.equal(storage_bytes(m), m_before)


@pytest.mark.parametrize("src_dev, dst_dev", DIRECTIONS)
def test_peer_copy_plan_runs_on_the_destination(src_dev, dst_dev):
    """The plan's device is the destination's, its peer the source's; "auto" takes SMs."""
    _, src, dst, _, _ = _on_gpus("multi", src_dev, dst_dev)
    plan = transfer.build_swap(src, dst, mapping(PAIRS), op="swap_blocks_multi_layer",
                               names=("src_caches", "dst_caches"), listed=True)
    assert plan.device == torch.device("cuda", dst_dev)
    assert plan.peer == torch.device("cuda", src_dev)
    assert plan.mapping.device == torch.device("cuda", dst_dev)
    assert copy_engine.resolve(plan) == "sm"
    again = transfer.build_swap(src, dst, mapping(PAIRS), op="swap_blocks_multi_layer",
                                names=("src_caches", "dst_caches"), listed=True)  # cached
    assert (again.device, again.peer) == (plan.device, plan.peer)


# --- CUDA graphs ------------------------------------------------------------------------------------

def _capture_stream(device: int) -> torch.cuda.Stream:
    """A capture stream on ``device``: torch.cuda.graph's default is one stream per process, made
    on the device current at the first capture (two H200s: a later capture meant for the other
    device recorded an empty graph while the call ran eagerly on its device's stream)."""
    return torch.cuda.Stream(device)


@pytest.mark.parametrize("engine", ["sm", "auto"])
@pytest.mark.parametrize("implementation", ["triton", "cuda"])
@pytest.mark.parametrize("src_dev, dst_dev", DIRECTIONS)
@pytest.mark.parametrize("name", ["swap", "multi", "relayout-heads"])
def test_peer_copy_graph_capture_and_replay(name, src_dev, dst_dev, implementation, engine):
    """Captured on a stream of the destination's device after one eager call of the pair (CUDA
    refuses to enable peer access inside a capture; the eager call enables it); each replay
    reads the mapping's new values."""
    op, src, dst, pre, post = _on_gpus(name, src_dev, dst_dev)
    initial = [storage_bytes(t).clone() for t in _flat(dst)]
    m = mapping(GPU_PAIRS, torch.int32, device=f"cuda:{dst_dev}")
    op(src, dst, *pre, m, *post, max_ctas=2, engine=engine, implementation=implementation)
    _sync(src_dev, dst_dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(dst_dev), torch.cuda.graph(graph, stream=_capture_stream(dst_dev)):
        op(src, dst, *pre, m, *post, max_ctas=2, engine=engine, implementation=implementation)
    for pairs in (NEW_PAIRS, GPU_PAIRS):
        with torch.cuda.device(dst_dev):
            for t, b in zip(_flat(dst), initial, strict=True):
                storage_bytes(t).copy_(b)
            m.copy_(mapping(pairs, torch.int32))
            graph.replay()
        _sync(src_dev, dst_dev)
        want_src, want_dst = _expected(name, pairs)
        _assert_bytes(dst, want_dst, "dst")
        _assert_bytes(src, want_src, "src")


@pytest.mark.parametrize("implementation", ["triton", "cuda"])
@pytest.mark.parametrize("src_dev, dst_dev", DIRECTIONS)
def test_a_pairs_first_call_under_capture_is_refused(monkeypatch, src_dev, dst_dev,
                                                     implementation):
    """A pair's first call inside a capture raises saying to call once before (CUDA would
    refuse to enable peer access there and invalidate the capture); nothing is written."""
    monkeypatch.setattr(copy_engine, "_PEERS", set())
    op, src, dst, pre, post = _on_gpus("multi", src_dev, dst_dev)
    before = [storage_bytes(t).clone() for t in _flat(dst)]
    m = mapping(GPU_PAIRS, torch.int32, device=f"cuda:{dst_dev}")
    _sync(src_dev, dst_dev)
    graph = torch.cuda.CUDAGraph()
    refused = pytest.raises(RuntimeError, match="not enabled by an earlier call.*before capturing")
    with refused, torch.cuda.device(dst_dev), torch.cuda.graph(graph,
                                                               stream=_capture_stream(dst_dev)):
        op(src, dst, *pre, m, *post, max_ctas=2, engine="sm", implementation=implementation)
    _sync(src_dev, dst_dev)
    for t, b in zip(_flat(dst), before, strict=True):
        assert torch.equal(storage_bytes(t), b)

# --- streams ----------------------------------------------------------------------------------------

def _hold(stream: torch.cuda.Stream, gate: torch.Tensor) -> None:
    """Work enqueued on ``stream`` after this waits until ``gate`` (int32 on its device) >= 1."""
    from cuda.bindings import driver

    with torch.cuda.device(stream.device):
        err, = driver.cuStreamWaitValue32(
            driver.CUstream(stream.cuda_stream), driver.CUdeviceptr(gate.data_ptr()), 1,
            int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))
    assert err == driver.CUresult.CUDA_SUCCESS, err


@pytest.mark.parametrize("implementation, engine, mapping_on", [
    ("cuda", "sm", "dst"), ("cuda", "sm", "cpu"), ("triton", "sm", "dst"), ("cuda", "ce", "cpu"),
    ("cuda", "auto", "cpu")])
@pytest.mark.parametrize("src_dev, dst_dev", DIRECTIONS)
def test_peer_copy_work_lands_on_the_destinations_current_stream(src_dev, dst_dev,
                                                                 implementation, engine,
                                                                 mapping_on):
    """With the SOURCE's device current and a held side stream current on the destination's,
    nothing is written until that stream is released: every other stream of both devices has
    finished by then (no timing: the stream waits on a value only the test writes)."""
    name = "multi"
    op, src, dst, pre, post = _on_gpus(name, src_dev, dst_dev)
    pairs = PAIRS if mapping_on == "cpu" else GPU_PAIRS

    def m():
        return (mapping(pairs) if mapping_on == "cpu"
                else mapping(pairs, device=f"cuda:{dst_dev}"))
    kw = dict(engine=engine, implementation=implementation)
    initial = [storage_bytes(t).clone() for t in _flat(dst)]
    op(src, dst, *pre, m(), *post, **kw)  # the variants loaded and peer access enabled first
    _sync(src_dev, dst_dev)
    for t, b in zip(_flat(dst), initial, strict=True):
        storage_bytes(t).copy_(b)
    side, other = torch.cuda.Stream(dst_dev), torch.cuda.Stream(dst_dev)
    gate = torch.zeros(1, dtype=torch.int32, device=f"cuda:{dst_dev}")
    mp = m()
    _sync(src_dev, dst_dev)
    _hold(side, gate)
    try:
        with torch.cuda.stream(side), torch.cuda.device(src_dev):
            assert torch.cuda.current_device() == src_dev
            op(src, dst, *pre, mp, *post, **kw)
            assert torch.cuda.current_device() == src_dev  # the caller's device is kept
        for d in (src_dev, dst_dev):
            torch.cuda.current_stream(d).synchronize()
            torch.cuda.default_stream(d).synchronize()
        with torch.cuda.stream(other):
            held = [storage_bytes(t).cpu() for t in _flat(dst)]
        for k, (h, b) in enumerate(zip(held, initial, strict=True)):
            assert torch.equal(h, b.cpu()), f"dst[{k}] was written before its stream ran"
    finally:
        with torch.cuda.stream(other):
            gate.fill_(1)
        side.synchronize()
    want_src, want_dst = _expected(name, pairs)
    _assert_bytes(dst, want_dst, "dst")
    _assert_bytes(src, want_src, "src")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("src_dev, dst_dev", DIRECTIONS)
def test_peer_copy_after_an_event_of_the_sources_writer(src_dev, dst_dev, implementation):
    """docs/ops/transfer.md's example: the source is written on a stream of its device; the
    destination's stream waits for an event recorded after it, then the call reads it."""
    name = "swap"
    op, src, dst, pre, post = _on_gpus(name, src_dev, dst_dev)
    _, host_src, _, _, _ = _case(name)
    fresh = storage_bytes(random_view(tuple(host_src.shape), host_src.stride(), host_src.dtype,
                                      offset=3, seed=99)).pin_memory()
    writer = torch.cuda.Stream(src_dev)
    with torch.cuda.stream(writer):
        storage_bytes(src).copy_(fresh, non_blocking=True)
        written = torch.cuda.Event()
        written.record()
    with torch.cuda.device(dst_dev):
        torch.cuda.current_stream().wait_event(written)
        op(src, dst, *pre, mapping(PAIRS), *post, implementation=implementation)
        torch.cuda.current_stream().synchronize()
    _sync(src_dev)
    # The host twin holds the fresh source bytes too.
    _, hs, hd, _, _ = _case(name)
    storage_bytes(hs).copy_(fresh)
    op(hs, hd, *pre, mapping(PAIRS), *post)
    _assert_bytes(dst, [storage_bytes(hd)], "dst")


# --- errors: nothing changed --------------------------------------------------------------------------

def _errors():
    """(id, make(src_dev, dst_dev) -> (op, args, kwargs), exception, message)."""
    def swap_mapping_on_src(s, d):
        a, b = _place(_case("swap")[1], s), _place(_case("swap")[2], d)
        return kvwrite.swap_blocks, (a, b, mapping(PAIRS, device=f"cuda:{s}")), {}

    def ce_gpu_mapping(s, d):
        a, b = _place(_case("swap")[1], s), _place(_case("swap")[2], d)
        return kvwrite.swap_blocks, (a, b, mapping(PAIRS, device=f"cuda:{d}")), {"engine": "ce"}

    def pack(s, d):
        caches = [random_view((7, 2, 4, 32), None, torch.bfloat16, seed=20).to(f"cuda:{s}")]
        pages = torch.zeros(8, transfer.kv_page_bytes(1, 2, 4, 32, torch.bfloat16),
                            dtype=torch.uint8, device=f"cuda:{d}")
        return kvwrite.pack_kv_pages, (caches, pages, mapping(PAIRS)), {}

    def unpack(s, d):
        pages = torch.randint(0, 256, (8, transfer.kv_page_bytes(1, 2, 4, 32, torch.bfloat16)),
                              dtype=torch.uint8, device=f"cuda:{s}")
        caches = [random_view((7, 2, 4, 32), None, torch.bfloat16, seed=21).to(f"cuda:{d}")]
        return kvwrite.unpack_kv_pages, (pages, caches, mapping([[1, 0], [3, 4]])), {}

    def pinned_beside_two(s, d):
        src = [_place(_case("swap")[1], s), _case("swap")[1].pin_memory()]
        dst = [_place(_case("swap")[2], d), _place(_case("swap")[2], d)]
        return kvwrite.swap_blocks_multi_layer, (src, dst, mapping(PAIRS)), {}

    def spread(s, d):
        src = [_place(_case("swap")[1], s), _place(_case("swap")[1], s)]
        dst = [_place(_case("swap")[2], d), _place(_case("swap")[2], s)]
        return kvwrite.swap_blocks_multi_layer, (src, dst, mapping(PAIRS)), {}

    one_gpu = ("(one GPU per call of {op}: pages move between GPUs through a transport such as "
               "torch.distributed), got cuda:{d}")
    return [
        ("mapping on the source", swap_mapping_on_src, ValueError,
         "block_mapping: expected host memory or cuda:{d} (the destination's device: a call "
         "across two GPUs runs there), got cuda:{s}"),
        ("ce with a GPU mapping", ce_gpu_mapping, ValueError,
         "engine: 'ce' reads the mapping on the host"),
        ("pack", pack, ValueError, "pages: expected the device of caches[0] (cuda:{s}) or pinned "
         "host memory " + one_gpu.replace("{op}", "pack_kv_pages")),
        ("unpack", unpack, ValueError, "caches[0]: expected the device of pages (cuda:{s}) or "
         "pinned host memory " + one_gpu.replace("{op}", "unpack_kv_pages")),
        ("pinned host beside two GPUs", pinned_beside_two, ValueError,
         "src_caches[1]: expected device cuda:{s} (that of src_caches[0]), got cpu"),
        ("a list spread over two GPUs", spread, ValueError,
         "dst_caches[1]: expected device cuda:{d} (that of dst_caches[0]), got cuda:{s}"),
    ]


@pytest.mark.parametrize("src_dev, dst_dev", DIRECTIONS)
@pytest.mark.parametrize("make, exc, text", [e[1:] for e in _errors()],
                         ids=[e[0] for e in _errors()])
def test_peer_errors_change_nothing(src_dev, dst_dev, make, exc, text):
    op, args, kwargs = make(src_dev, dst_dev)
    _sync(src_dev, dst_dev)
    flat = tuple(t for a in args for t in (a if isinstance(a, list) else [a]))
    before = conformance.snapshot(flat, kwargs)
    with pytest.raises(exc, match="^" + re.escape(text.format(s=src_dev, d=dst_dev))):
        op(*args, **kwargs)
    _sync(src_dev, dst_dev)
    assert conformance.unchanged(before)


@pytest.mark.parametrize("src_dev, dst_dev", DIRECTIONS)
def test_peer_copy_without_peer_access_is_refused(monkeypatch, src_dev, dst_dev):
    """Where the destination cannot access the source's memory, the call names the source."""
    monkeypatch.setattr(transfer, "_can_access_peer", lambda device, peer: False)
    _, src, dst, _, _ = _on_gpus("multi", src_dev, dst_dev)
    m = mapping(PAIRS)
    before = conformance.snapshot((*src, *dst, m), {})
    with pytest.raises(ValueError, match="^" + re.escape(
            f"src_caches[0]: expected a GPU that cuda:{dst_dev} (the device of dst_caches[0]) "
            f"can access as a peer, got cuda:{src_dev}: peer access between cuda:{src_dev} and "
            f"cuda:{dst_dev} is unavailable")):
        kvwrite.swap_blocks_multi_layer(src, dst, m)
    _sync(src_dev, dst_dev)
    assert conformance.unchanged(before)
