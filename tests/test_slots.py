"""Slot patterns (kvwrite.testing.slots): what a decode, prefill or mixed batch writes, padding,
reproducibility, vLLM's random slots, and the benchmark's check on such batches."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvwrite.bench.check import check_point
from kvwrite.bench.workload import fill_caches, make_caches, make_input_sets, seed_everything
from kvwrite.ops.reshape_and_cache_flash import reference as torch_ref
from kvwrite.testing import Case, clone_caches
from kvwrite.testing.slots import BlockAllocator, SlotPattern, make_slots

BS = 16


def _owned_blocks(batch) -> list[int]:
    return [b for s in batch.sequences for b in s.block_table]


def test_allocator_hands_out_each_block_once_from_a_shuffled_list():
    alloc = BlockAllocator(64, np.random.default_rng(0))
    got = alloc.allocate(10) + alloc.allocate(54)
    assert sorted(got) == list(range(64))
    assert got != list(range(64))  # scattered, not in id order
    with pytest.raises(ValueError, match="raise --num-blocks"):
        alloc.allocate(1)


@pytest.mark.parametrize("context_len", [0, 15, 16, 100, 4096])
def test_decode_appends_at_each_sequences_next_offset(context_len):
    batch = make_slots(SlotPattern("decode", context_len=context_len), 40, 512, BS)
    assert len(batch.sequences) == 40 and batch.num_padding == 0
    owned = _owned_blocks(batch)
    assert len(owned) == len(set(owned))  # no block belongs to two sequences
    new_blocks = 0
    for t, seq in enumerate(batch.sequences):
        c = seq.start
        assert seq.num_new == 1 and 0 <= c <= context_len
        # The sequence holds exactly the blocks its c cached tokens plus the new one need ...
        assert len(seq.block_table) == c // BS + 1
        # ... and the new token lands at position c: offset c % BS of its last block.
        slot = int(batch.slots[t])
        assert divmod(slot, BS) == (seq.block_table[-1], c % BS)
        if c % BS == 0:  # the previous last block was full: a fresh block, written at offset 0
            new_blocks += 1
            assert slot % BS == 0
    if context_len == 0:
        assert new_blocks == 40
    assert len(set(batch.slots.tolist())) == 40


def test_decode_contexts_are_capped_so_the_blocks_fit():
    # 64 blocks for 32 sequences: at most 2 blocks each, so contexts stay below 2 * BS.
    batch = make_slots(SlotPattern("decode", context_len=10_000), 32, 64, BS)
    assert max(s.start for s in batch.sequences) < 2 * BS
    assert len(_owned_blocks(batch)) <= 64
    with pytest.raises(ValueError, match="--num-blocks"):
        make_slots(SlotPattern("decode"), 65, 64, BS)


@pytest.mark.parametrize("num_tokens,prefill_len", [(64, 32), (100, 48), (7, 512)])
def test_prefill_offsets_are_consecutive_over_whole_blocks(num_tokens, prefill_len):
    batch = make_slots(SlotPattern("prefill", prefill_len=prefill_len), num_tokens, 256, BS)
    assert len(batch.sequences) == -(-num_tokens // prefill_len)
    assert [s.num_new for s in batch.sequences][:-1] == [prefill_len] * (len(batch.sequences) - 1)
    assert sum(s.num_new for s in batch.sequences) == num_tokens
    t = 0
    for seq in batch.sequences:
        assert seq.start == 0 and len(seq.block_table) == -(-seq.num_new // BS)
        for p in range(seq.num_new):
            block, offset = divmod(int(batch.slots[t]), BS)
            assert offset == p % BS and block == seq.block_table[p // BS]
            if p % BS:
                assert batch.slots[t] == batch.slots[t - 1] + 1  # consecutive inside a block
            t += 1
    owned = _owned_blocks(batch)
    assert len(owned) == len(set(owned))


def test_mixed_is_decode_tokens_then_one_chunk():
    pat = SlotPattern("mixed", decode_fraction=0.25, context_len=100)
    batch = make_slots(pat, 64, 256, BS)
    *decodes, chunk = batch.sequences
    assert len(decodes) == 16 and all(s.num_new == 1 for s in decodes)
    assert chunk.num_new == 48 and 0 <= chunk.start <= 100
    assert len(chunk.block_table) == -(-(chunk.start + 48) // BS)
    for i, p in enumerate(range(chunk.start, chunk.start + 48)):
        assert batch.slots[16 + i] == chunk.slot(p, BS)
    for t, s in enumerate(decodes):
        assert batch.slots[t] == s.slot(s.start, BS)


@pytest.mark.parametrize("kind", ["random", "decode", "prefill", "mixed"])
def test_padding_is_trailing_minus_one(kind):
    random.seed(0)
    pat = SlotPattern(kind, pad_fraction=0.25, prefill_len=8)
    batch = make_slots(pat, 32, 256, BS)
    assert batch.num_padding == 8
    assert (batch.slots[-8:] == -1).all() and (batch.slots[:-8] >= 0).all()
    assert len(set(batch.slots[:-8].tolist())) == 24
    assert sum(s.num_new for s in batch.sequences) == (0 if kind == "random" else 24)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_patterns_are_reproducible_from_the_seed(kind):
    pat = SlotPattern(kind, prefill_len=20)
    a = make_slots(pat, 50, 512, BS, set_index=0)
    assert (a.slots == make_slots(pat, 50, 512, BS, set_index=0).slots).all()
    assert not (a.slots == make_slots(pat, 50, 512, BS, set_index=1).slots).all()
    other = SlotPattern(kind, prefill_len=20, seed=7)
    assert not (a.slots == make_slots(other, 50, 512, BS).slots).all()


def test_random_set_0_is_vllms_slots():
    case = Case(num_tokens=0, num_heads=2, head_size=64, num_blocks=64)
    sets = make_input_sets(case, 16, 3, torch.device("cpu"))
    # vLLM's recipe, restated: seed everything with 42, draw key and value, then sample slots.
    seed_everything(42)
    key = torch.randn(16, 2, 64, dtype=torch.bfloat16)
    torch.randn_like(key)
    want = random.sample(range(64 * 16), 16)
    assert sets[0].slot_mapping.tolist() == want
    assert torch.equal(sets[0].key, key)


def test_bytes_leave_out_the_padding():
    case = Case(num_tokens=16, num_heads=2, head_size=64, slots=SlotPattern("decode", pad_fraction=0.25))
    assert case.num_real() == 12
    assert case.bytes_moved() == 2 * 12 * 2 * 64 * (2 + 2) + 16 * 8
    assert "decode" in case.id and "pad_fraction0.25" in case.id


# --- the benchmark's check on these batches ------------------------------------------------------

def _point(kind: str, pad: float, layout: str = "NHD"):
    case = Case.named_layout(layout, num_tokens=0, num_heads=2, head_size=64, num_blocks=96,
                             slots=SlotPattern(kind, pad_fraction=pad, prefill_len=24,
                                               context_len=40))
    caches = make_caches(case, torch.device("cpu"))
    fill_caches(*caches, case)
    (inp,) = make_input_sets(case, 48, 1, torch.device("cpu"))
    return case, caches, inp


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_check_passes_the_reference_with_padding_and_shared_blocks(kind, layout):
    case, caches, inp = _point(kind, 0.25, layout)
    assert (inp.slot_mapping[-12:] == -1).all()
    before = clone_caches(SimpleNamespace(key_cache=caches[0], value_cache=caches[1]))
    assert check_point(torch_ref.run, *caches, inp, case) is None
    # The reference skipped padding: every byte outside the real tokens' rows is unchanged.
    real = inp.slot_mapping[:-12]
    for got, was in zip(caches, before, strict=True):
        mask = torch.ones(got.shape[:2], dtype=torch.bool)
        mask[real // 16, real % 16] = False
        assert torch.equal(got[mask].view(torch.uint8), was[mask].view(torch.uint8))


def _writes_padding_to_the_end(key, value, key_cache, value_cache, slot_mapping, cache_dtype,
                               k_scale, v_scale):
    """Wrong: indexes with -1 as Python does, so padding tokens land in the last slot."""
    bs = key_cache.shape[1]
    s = slot_mapping.long()
    for src, cache in ((key, key_cache), (value, value_cache)):
        cache[s // bs, s % bs] = src[: s.numel()].to(cache.dtype)


def _skips_first_of_each_block(key, value, key_cache, value_cache, slot_mapping, cache_dtype,
                               k_scale, v_scale):
    """Wrong: drops tokens at offset 0 (a sequence's fresh block)."""
    s = slot_mapping.clone()
    s[(s % key_cache.shape[1]) == 0] = -1
    torch_ref.run(key, value, key_cache, value_cache, s, cache_dtype, k_scale, v_scale)


def test_check_catches_a_write_of_padding():
    case, caches, inp = _point("decode", 0.25)
    assert check_point(_writes_padding_to_the_end, *caches, inp, case) is not None


def test_check_catches_a_missed_token_of_a_prefill():
    case, caches, inp = _point("prefill", 0.0)
    reason = check_point(_skips_first_of_each_block, *caches, inp, case)
    assert reason is not None and "differ from the reference" in reason


# --- serving shapes of the --model presets ----------------------------------------------------------

def _config(*argv):
    """The seed benchmark's token counts and slot pattern for these flags."""
    import types

    from kvwrite.bench import engine
    from kvwrite.bench.ops.reshape_and_cache_flash import BENCH
    args = engine.configure(BENCH, list(argv), "kvwrite-bench")[1]
    return types.SimpleNamespace(num_tokens=args.token_counts, slots=args.pattern)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_model_decode_sweeps_the_running_batch_up_to_the_context_window(device):
    cfg = _config("--device", device, "--model", "llama-3.1-8b", "--slots", "decode")
    assert cfg.num_tokens == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    # The new token takes position context_len at most: the last one of the 131072-token window.
    assert (cfg.slots.context_len, cfg.slots.max_position) == (131071, 131072)
    assert cfg.slots.describe() == "decode(context_len=131071, max_position=131072)"


@pytest.mark.parametrize("kind", ["prefill", "mixed"])
def test_model_prefill_and_mixed_sweep_the_step_budget(kind):
    cfg = _config("--model", "qwen3-8b", "--slots", kind)
    assert cfg.num_tokens == [512, 1024, 2048, 4096, 8192]
    assert cfg.slots.max_position == 40960
    assert cfg.slots.prefill_len == 2048
    assert cfg.slots.decode_tokens == (256 if kind == "mixed" else None)


def test_model_with_random_slots_keeps_the_users_sweep():
    cfg = _config("--model", "llama-3.1-8b")
    assert cfg.slots.is_default
    assert cfg.num_tokens == _config().num_tokens  # vLLM's 2..65536


def test_explicit_flags_win_over_the_serving_shape():
    cfg = _config("--model", "llama-3.1-8b", "--slots", "decode", "--num-tokens", "3,5",
                  "--context-len", "100")
    assert cfg.num_tokens == [3, 5] and cfg.slots.context_len == 100
    cfg = _config("--model", "llama-3.1-8b", "--slots", "mixed", "--decode-tokens", "32")
    assert cfg.slots.decode_tokens == 32
    cfg = _config("--model", "llama-3.1-8b", "--slots", "prefill", "--prefill-len", "64")
    assert cfg.slots.prefill_len == 64
    # mixed writes one prefill chunk: --prefill-len (which it does not read) is refused.
    with pytest.raises(ValueError, match="--prefill-len: only read with --slots prefill"):
        _config("--model", "llama-3.1-8b", "--slots", "mixed", "--prefill-len", "64")
    # A decode fraction given keeps mixed on its fraction.
    cfg = _config("--model", "llama-3.1-8b", "--slots", "mixed", "--decode-fraction", "0.25")
    assert cfg.slots.decode_tokens is None and cfg.slots.decode_fraction == 0.25
    assert cfg.slots.describe().startswith("mixed(decode_fraction=0.25,")


def test_prefill_len_is_capped_by_a_small_context_window():
    from kvwrite.bench.models import MODELS, ServingShape, serving_flags
    assert MODELS["gemma-2-9b"].max_position == 8192
    long_prompts = ServingShape(prefill_len=16384)
    assert serving_flags("gemma-2-9b", "prefill", set(), long_prompts)["prefill_len"] == 8192
    assert serving_flags("llama-3.1-8b", "prefill", set(), long_prompts)["prefill_len"] == 16384
    assert serving_flags("gemma-2-9b", "prefill", {"prefill_len"}, long_prompts).get(
        "prefill_len") is None
    # A prompt longer than the window, given explicitly, is an error naming the flag.
    with pytest.raises(ValueError, match="--prefill-len: expected at most max_position = 8192"):
        _config("--model", "gemma-2-9b", "--slots", "prefill", "--prefill-len", "9000")


def test_every_preset_names_its_context_window_in_its_source():
    from kvwrite.bench.models import MODELS
    for m in MODELS.values():
        assert f"max_position_embeddings={m.max_position}" in m.source


@pytest.mark.parametrize("num_tokens,decode_tokens", [(512, 256), (100, 256), (300, 0)])
def test_mixed_with_decode_tokens_is_the_running_batch_then_one_chunk(num_tokens, decode_tokens):
    pat = SlotPattern("mixed", decode_tokens=decode_tokens, context_len=1000, pad_fraction=0.125)
    batch = make_slots(pat, num_tokens, 4096, BS)
    n = num_tokens - batch.num_padding
    d = min(decode_tokens, n)
    decodes, rest = batch.sequences[:d], batch.sequences[d:]
    assert all(s.num_new == 1 for s in decodes)
    for t, s in enumerate(decodes):  # the first D tokens append at their sequences' next offset
        assert batch.slots[t] == s.slot(s.start, BS) and len(s.block_table) == s.start // BS + 1
    if d == n:
        assert rest == []
    else:  # the rest: one chunk at consecutive positions of one sequence
        (chunk,) = rest
        assert chunk.num_new == n - d
        want = [chunk.slot(p, BS) for p in range(chunk.start, chunk.start + chunk.num_new)]
        assert batch.slots[d:n].tolist() == want
    assert (batch.slots[n:] == -1).all()


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_positions_are_each_tokens_place_in_its_sequence_below_max_position(kind):
    pat = SlotPattern(kind, context_len=10_000, prefill_len=40, max_position=64,
                      pad_fraction=0.25, decode_tokens=8)
    for set_index in range(5):
        batch = make_slots(pat, 48, 1024, BS, set_index=set_index)
        pos = batch.positions()
        n = 48 - batch.num_padding
        assert (pos[n:] == 0).all() and pos.min() >= 0 and pos.max() < 64
        t = 0
        for s in batch.sequences:
            assert pos[t:t + s.num_new].tolist() == list(range(s.start, s.start + s.num_new))
            t += s.num_new
        assert t == n
    assert make_slots(SlotPattern(), 8, 64, BS).positions() is None
    with pytest.raises(ValueError, match="does not fit below max_position = 64"):
        make_slots(SlotPattern("mixed", decode_tokens=0, max_position=64), 80, 1024, BS)


def test_model_header_and_rows_show_the_serving_shape(tmp_path, capsys):
    import json

    from kvwrite.bench.cli import main
    js = tmp_path / "r.json"
    argv = ["--device", "cpu", "--model", "gemma-2-9b", "--slots", "decode", "--num-blocks", "512",
            "--layouts", "NHD", "--iters", "2", "--time-budget", "0.01", "--json", str(js)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "# slots: decode(context_len=8191, max_position=8192): " in out
    assert "at T=256 the 512 blocks cap contexts at 31" in out
    rows = json.loads(js.read_text())["rows"]
    assert [r["num_tokens"] for r in rows] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert {r["slot_params"] for r in rows} == {"decode(context_len=8191, max_position=8192)"}
    assert {r["check"] for r in rows} == {"passed"} and {r["model"] for r in rows} == {"gemma-2-9b"}
