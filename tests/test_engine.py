"""The benchmark engine across every subcommand (CPU): one grammar, one-line errors before any
work, Ctrl-C keeps what was measured, small CPU defaults, report and plot of any subcommand's
JSON, output paths really written, optional packages named, every op's sanitize cases."""

import json
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import kvwrite
import tools.sanitize as sanitize
from kvwrite import registry
from kvwrite.bench import cli, engine
from kvwrite.bench.cli import main
from kvwrite.bench.models import MODELS

ROOT = str(Path(__file__).resolve().parents[1])  # the checkout (its tools/ is not installed)
SRC = str(Path(ROOT) / "src")

# A tiny CPU run of each subcommand (torch implementation), a few seconds at most.
TINY = {
    "reshape_and_cache_flash": ["--device", "cpu", "--num-tokens", "2,16", "--num-heads", "2",
                                "--head-size", "64", "--num-blocks", "64", "--iters", "3"],
    "rope": ["rope", "--device", "cpu", "--num-tokens", "2,16", "--heads", "4,2,32", "--dtypes",
             "float16", "--kv-cache-dtypes", "auto", "--iters", "3", "--time-budget", "0.01"],
    "mla": ["mla", "--device", "cpu", "--num-blocks", "8", "--block-size", "16", "--num-tokens",
            "2,8,16", "--iters", "3", "--time-budget", "0.01", "--graph-calls", "2"],
    "legacy": ["legacy", "--device", "cpu", "--num-tokens", "2,8,16", "--num-heads", "2",
               "--head-size", "64", "--num-blocks", "8", "--iters", "3", "--graph-calls", "2",
               "--time-budget", "0.01"],
    "per-token-head": ["per-token-head", "--device", "cpu", "--num-blocks", "4", "--block-size",
                       "16", "--num-heads", "2", "--head-size", "64", "--modes", "int8,int4",
                       "--num-tokens", "2,16", "--iters", "3", "--time-budget", "0.01",
                       "--graph-calls", "2"],
    "nvfp4": ["nvfp4", "--device", "cpu", "--num-blocks", "4", "--block-size", "16",
              "--num-heads", "2", "--head-size", "64", "--num-tokens", "2,16", "--iters", "3",
              "--time-budget", "0.01", "--graph-calls", "2"],
    "qk-norm-rope": ["qk-norm-rope", "--device", "cpu", "--heads", "4,2,32", "--num-tokens",
                     "2,16", "--kv-cache-dtypes", "auto,fp8", "--iters", "3", "--time-budget",
                     "0.01", "--graph-calls", "2"],
    "gather": ["gather", "--device", "cpu", "--num-blocks", "16", "--block-size", "16",
               "--num-heads", "2", "--head-size", "64", "--entry", "96", "--num-tokens",
               "16,32,64", "--iters", "3", "--time-budget", "0.01", "--graph-calls", "2",
               "--kinds", "cp,flash"],
    "indexer": ["indexer", "--device", "cpu", "--num-blocks", "4", "--block-size", "16",
                "--num-tokens", "2,8,16", "--iters", "3", "--time-budget", "0.01",
                "--graph-calls", "2"],
}
# The transfer ops (SPEC §9) and the subcommand their declaration registers.
HAS_TRANSFER = hasattr(kvwrite, "swap_blocks_multi_layer")
if HAS_TRANSFER:
    TINY["transfer"] = ["transfer", "--device", "cpu", "--model", "llama3-8b", "--layers", "2",
                        "--op", "swap,pack", "--direction", "d2h", "--page-format", "raw,fp8",
                        "--num-tokens", "2,16", "--engine", "sm", "--max-ctas", "all",
                        "--peers", "torch", "--iters", "3", "--time-budget", "0.01",
                        "--graph-calls", "2"]
# The TurboQuant and MX writes (SPEC §10) and the subcommands their declarations register.
HAS_TURBOQUANT = hasattr(kvwrite, "reshape_and_cache_turboquant")
HAS_MX = hasattr(kvwrite, "mx_gather_cache")
NEEDS_45 = "needs the issue-45 ops"
if HAS_TURBOQUANT:
    TINY["turboquant"] = ["turboquant", "--device", "cpu", "--num-blocks", "4", "--block-size",
                          "16", "--num-heads", "2", "--head-size", "128", "--num-tokens", "2,16",
                          "--iters", "3", "--time-budget", "0.01", "--graph-calls", "2"]
if HAS_MX:
    TINY["mx"] = ["mx", "--device", "cpu", "--num-blocks", "4", "--block-size", "16",
                  "--num-heads", "2", "--head-size", "64", "--num-tokens", "2,16", "--iters", "3",
                  "--time-budget", "0.01", "--graph-calls", "2"]
SUBS = sorted(TINY)


def _bench(sub: str):
    return cli.bench_of(sub)


def _sub_argv(sub: str) -> list[str]:
    """The subcommand word (none for the default subcommand)."""
    return [] if sub == "reshape_and_cache_flash" else [sub]


# --- the grammar and the help ----------------------------------------------------------------------

def test_help_lists_every_subcommand_with_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, command in cli.subcommands().items():
        assert re.search(rf"^  {name}\b.*{re.escape(command.summary)}$", out, re.M), name
        for a in command.aliases:
            assert f"({a})" in out or f"{a}," in out
    for tool in cli.TOOLS:
        assert re.search(rf"^  {tool}\s", out, re.M), tool


@pytest.mark.parametrize("sub", list(cli.subcommands()))
def test_every_flag_of_every_subcommand_is_documented(sub):
    parser = engine.build_parser(_bench(sub), sub)
    for action in parser._actions:
        if action.dest in ("help",):
            continue
        assert action.help and len(action.help) > 3, (sub, action.option_strings)


@pytest.mark.parametrize("sub", SUBS)
@pytest.mark.parametrize("text, want", [("2,16", [2, 16]), ("2 16", [2, 16]), ("2:16", [2, 4, 8, 16])])
def test_num_tokens_takes_one_grammar_everywhere(sub, text, want):
    argv = [*TINY[sub][len(_sub_argv(sub)):], "--num-tokens", *text.split(" ")]
    _, args, points, _ = engine.configure(_bench(sub), argv, sub)
    assert args.token_counts == want
    assert sorted({p.num_tokens for p in points}) == want


COMMON_BAD = [
    (["--num-tokens", "-5"], "--num-tokens"), (["--num-tokens", "0"], "--num-tokens"),
    (["--num-tokens", "64:2"], "--num-tokens"), (["--num-tokens", "x"], "--num-tokens"),
    (["--implementation", "bogus"], "--implementation"), (["--device", "bogus"], "--device"),
    (["--iters", "0"], "--iters"), (["--graph-calls", "0"], "--graph-calls"),
    (["--time-budget", "0"], "--time-budget"), (["--time-budget", "nan"], "--time-budget"),
    (["--baseline", "nope"], "--baseline"), (["--json", "/proc/x.json"], "--json"),
    (["--csv", "/proc/x.csv"], "--csv"), (["--plot", "a.txt"], "--plot"),
    (["--plot", "/no/such/folder/p.png"], "--plot"), (["--mode", "x"], "--mode"),
    (["--timer", "x"], "--timer"), (["--no-such-flag"], "--no-such-flag"),
    # Conflicting or empty: each refused, never silently resolved.
    (["--no-graph", "--mode", "cudagraph"], "--no-graph"),
    (["--json", "x.json", "--csv", "x.json"], "--csv"),
    (["--json", "x.json", "--plot", "./x.json"], "--plot"),
    (["--num-tokens", "2,,16"], "--num-tokens"), (["--num-tokens", "2,16,"], "--num-tokens"),
    (["--implementation", "torch,,torch"], "--implementation"),
    (["--threads", "0"], "--threads"), (["--threads", "x"], "--threads"),
]
# The slot flags a pattern does not read, on every subcommand that has slot patterns.
SLOT_BAD = [
    (["--decode-tokens", "4"], "--decode-tokens"),
    (["--slots", "decode", "--decode-tokens", "4"], "--decode-tokens"),
    (["--slots", "mixed", "--decode-tokens", "2", "--decode-fraction", "0.5"], "--decode-tokens"),
    (["--decode-fraction", "0.5"], "--decode-fraction"),
    (["--context-len", "5"], "--context-len"), (["--prefill-len", "8"], "--prefill-len"),
]
OWN_BAD = {
    "reshape_and_cache_flash": [
        (["--layouts", "NHD,XYZ"], "--layouts"), (["--head-size", "100"], "--head-size"),
        (["--num-heads", "0"], "--num-heads"), (["--num-blocks", "-3"], "--num-blocks"),
        (["--num-heads", "8", "--tp", "3"], "--tp"), (["--model", "nope"], "--model"),
        (["--model", "llama-3.1-8b", "--num-heads", "4"], "--model"),
        (["--dtype", "bogus"], "--dtype"), (["--kv-cache-dtype", "bogus"], "--kv-cache-dtype"),
        (["--slots", "bogus"], "--slots"), (["--pad-fraction", "2"], "--pad-fraction"),
        (["--layouts", "NHD,,HND"], "--layouts"), (["--per-head-scale"], "--per-head-scale"),
        (["--fp8-scales", "1,1"], "--fp8-scales"),
        (["--kv-cache-dtype", "fp8", "--fp8-scales", "1"], "--fp8-scales"),
        (["--kv-cache-dtype", "fp8", "--fp8-scales", "1,x"], "--fp8-scales"),
        (["--num-tokens", "2048"], "--num-blocks"),
        (["--slots", "decode", "--num-tokens", "128"], "--num-blocks")],
    "rope": [
        (["--dtypes", "bogus"], "--dtypes"), (["--heads", "bogus"], "--heads"),
        (["--heads", "4,2,0"], "--heads"), (["--kinds", "bogus"], "--kinds"),
        (["--layouts", "bogus"], "--layouts"), (["--max-position", "0"], "--max-position"),
        (["--block-size", "0"], "--block-size"), (["--rot-dim", "256"], "--rot-dim"),
        (["--rot-dim", "0"], "--rot-dim"), (["--rot-dim", "3"], "--rot-dim"),
        (["--num-blocks", "-3"], "--num-blocks"), (["--kv-cache-dtypes", "bogus"],
                                                   "--kv-cache-dtypes"),
        (["--model", "bogus"], "--model"), (["--slots", "bogus"], "--slots"),
        (["--pad-fraction", "2"], "--pad-fraction"), (["--kinds", "fused,,pair"], "--kinds"),
        (["--layouts", "NHD,"], "--layouts"), (["--heads", "4,2,32;"], "--heads"),
        (["--model", "llama-3.1-8b"], "--model")],
    "mla": [
        (["--kv-lora-rank", "0"], "--kv-lora-rank"), (["--pe-dim", "0"], "--pe-dim"),
        (["--num-blocks", "0"], "--num-blocks"), (["--block-size", "0"], "--block-size"),
        (["--kv-cache-dtype", "bogus"], "--kv-cache-dtype"),
        (["--kv-cache-dtype", "fp8_ds_mla", "--kv-lora-rank", "256"],
         "--kv-cache-dtype fp8_ds_mla"),
        (["--kv-cache-dtype", "fp8_ds_mla", "--dtype", "float"], "--kv-cache-dtype fp8_ds_mla"),
        (["--slots", "bogus"], "--slots"), (["--num-tokens", "256"], "--num-blocks")],
    "legacy": [
        (["--layouts", "NHD"], "--layouts"), (["--head-size", "100"], "--head-size"),
        (["--num-heads", "0"], "--num-heads"), (["--kv-cache-dtype", "bogus"], "--kv-cache-dtype"),
        (["--num-tokens", "1024"], "--num-blocks")],
    "per-token-head": [
        (["--modes", "int8,int5"], "--modes"), (["--head-size", "63", "--modes", "int4"],
                                                "--head-size"),
        (["--head-size", "62"], "--head-size"), (["--layouts", "NHD,X"], "--layouts"),
        (["--kv-alloc", "x"], "--kv-alloc"), (["--num-heads", "0"], "--num-heads"),
        (["--model", "llama-3.1-8b", "--num-heads", "4"], "--model"),
        (["--num-heads", "8", "--tp", "3"], "--tp"), (["--modes", "int8,"], "--modes"),
        (["--slots", "decode"], "--num-blocks")],
    "nvfp4": [
        (["--modes", "nvfp5"], "--modes"), (["--head-size", "40"], "--head-size"),
        (["--head-size", "48"], "--v-scale-layouts"),
        (["--v-scale-layouts", "x"], "--v-scale-layouts"), (["--layouts", "X"], "--layouts"),
        (["--kinds", "fp4"], "--kinds"), (["--block-size", "0"], "--block-size"),
        (["--num-tokens", "128"], "--num-blocks")],
    "qk-norm-rope": [
        (["--model", "qwen9"], "--model"), (["--heads", "4,2"], "--heads"),
        (["--heads", "4,2,33"], "--heads"), (["--model", "qwen3-8b", "--heads", "4,2,32"],
                                             "--heads"),
        (["--dtype", "int8"], "--dtype"), (["--kv-cache-dtypes", "x"], "--kv-cache-dtypes"),
        (["--layouts", "Y"], "--layouts"), (["--max-position", "0"], "--max-position"),
        (["--kinds", "fused,x"], "--kinds"), (["--kinds", "fused,,pair"], "--kinds"),
        (["--fp8-scales", "1"], "--fp8-scales")],
    "gather": [
        (["--kv-cache-dtypes", "fp4"], "--kv-cache-dtypes"), (["--mix", "x"], "--mix"),
        (["--num-seqs", "0"], "--num-seqs"), (["--entry", "0"], "--entry"),
        (["--kinds", "dequant,x"], "--kinds"), (["--dtype", "float"], "--dtype"),
        (["--kinds", "cp,,flash"], "--kinds"), (["--num-tokens", "4096"], "--num-blocks")],
    "indexer": [
        (["--head-dim", "0"], "--head-dim"), (["--quant-block-size", "48"], "--quant-block-size"),
        (["--block-size", "0"], "--block-size"), (["--num-blocks", "-1"], "--num-blocks"),
        (["--dtype", "x"], "--dtype"), (["--scale-fmts", "ue8m0,x"], "--scale-fmts"),
        (["--scale-fmts", "ue8m0,mxfp8", "--quant-block-size", "64"], "--quant-block-size"),
        (["--slots", "bogus"], "--slots"), (["--num-tokens", "128"], "--num-blocks")],
    "transfer": [
        (["--model", "llama-3.1-8b"], "--model"), (["--model", "llama3-8b,"], "--model"),
        (["--direction", "up"], "--direction"), (["--op", "swap,x"], "--op"),
        (["--page-format", "fp4"], "--page-format"), (["--engine", "gpu"], "--engine"),
        (["--max-ctas", "0"], "--max-ctas"), (["--max-ctas", "two"], "--max-ctas"),
        (["--peers", "vllm"], "--peers"), (["--layers", "0"], "--layers"),
        (["--blocks", "4"], "--blocks"), (["--mode", "cudagraph"], "--mode"),
        (["--op", "relayout", "--direction", "d2h"], "--direction"),
        # Between cuda:0 and cuda:1: --device cpu (and no 2 GPUs here) is a usage error.
        (["--direction", "p2p"], "--direction"), (["--direction", "d2h,p2p:1to0"], "--direction"),
        (["--op", "handoff", "--direction", "d2d"], "--direction")],
    "turboquant": [
        (["--presets", "turboquant_2bit"], "--presets"), (["--presets", "turboquant_k8v4,"],
                                                          "--presets"),
        # Not a power of two: the MSE presets have no tables (turboquant_tables raises).
        (["--head-size", "96"], "--head-size"),
        (["--head-size", "12", "--presets", "turboquant_3bit_nc"], "--head-size"),
        (["--head-size", "7", "--presets", "turboquant_k8v4"], "--head-size"),
        (["--kinds", "fp4"], "--kinds"), (["--kinds", "turboquant,,fp8"], "--kinds"),
        (["--num-heads", "0"], "--num-heads"), (["--block-size", "0"], "--block-size"),
        (["--dtype", "int8"], "--dtype"), (["--num-tokens", "128"], "--num-blocks")],
    "mx": [
        (["--modes", "mxfp6"], "--modes"), (["--modes", "mxfp8,"], "--modes"),
        (["--head-size", "48"], "--head-size"), (["--scale-rules", "round"], "--scale-rules"),
        (["--scale-layouts", "swizzled"], "--scale-layouts"),
        # interleaved128 needs D = 128 and block_size % 128 == 0 (here 64 and 16).
        (["--scale-layouts", "interleaved128"], "--scale-layouts"),
        (["--kinds", "nvfp4"], "--kinds"), (["--block-size", "0"], "--block-size"),
        (["--num-tokens", "128"], "--num-blocks")],
}


def _has_slots(sub: str) -> bool:
    return "--decode-tokens" in engine.build_parser(_bench(sub), sub)._option_string_actions


BAD = [(sub, argv, flag) for sub in SUBS
       for argv, flag in COMMON_BAD + OWN_BAD[sub] + (SLOT_BAD if _has_slots(sub) else [])]


@pytest.mark.parametrize("sub, argv, flag", BAD,
                         ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD])
def test_every_bad_flag_is_one_line_and_exit_2_before_any_work(no_bench_work, capsys, sub, argv,
                                                               flag):
    with pytest.raises(SystemExit) as e:
        main([*TINY[sub], *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], err
    assert not os.path.exists("/proc/x.json") and not os.path.exists("x.json")


# --- issue 41: the walk-through on a CPU machine ---------------------------------------------------

# transfer's --model names SPEC §9.6's presets (layers, rows), not bench/models.py's.
MODEL_SUBS = [s for s in cli.subcommands() if s != "transfer"
              and "--model" in engine.build_parser(_bench(s), s)._option_string_actions]


@pytest.mark.parametrize("sub", MODEL_SUBS)
@pytest.mark.parametrize("model", list(MODELS))
def test_every_model_subcommand_takes_the_one_model_list(sub, model):
    """Every preset of bench/models.py configures on the CPU's defaults (whose small --heads is
    no user input), or is refused in one line naming --model where the op cannot run its shape
    (qk-norm-rope: the models without a QK norm)."""
    from kvwrite.bench.ops.fused_qk_norm_rope_and_reshape_cache_flash import PRESETS

    argv = ["--device", "cpu", "--model", model]
    if sub == "fused_qk_norm_rope_and_reshape_cache_flash" and MODELS[model].qk_norm is None:
        with pytest.raises(ValueError, match=rf"^--model: {re.escape(model)} has no QK norm"):
            engine.configure(_bench(sub), argv, sub)
        return
    _, args, points, _ = engine.configure(_bench(sub), argv, sub)
    if sub == "fused_qk_norm_rope_and_reshape_cache_flash":
        assert args.shapes == [(model, PRESETS[model])]
    m = MODELS[model]
    assert {(p.num_heads if hasattr(p, "num_heads") else p.case.num_heads) for p in points} == {
        m.num_kv_heads}


@pytest.mark.xfail(not HAS_TRANSFER, reason="needs the transfer ops", strict=True)
def test_transfer_tiny_run_checks_every_series(capsys, tmp_path):
    """Every point of the tiny run is checked against the torch reference and measured; the rows
    carry the limit of their direction and the call's host time."""
    js = tmp_path / "t.json"
    assert main([*TINY["transfer"], "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["rows"]
    assert rows and all(r["status"] == "ok" and r["check"] == "passed" for r in rows)
    assert {(r["operation"], r["engine"]) for r in rows} == {("swap", "sm"), ("swap", "torch"),
                                                            ("pack", "sm")}
    assert all(r["limit"] == "d2h" and r["limit_gbps"] > 0 and r["host_us"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "% limit" in out and "host (µs)" in out


# --- issue 45: turboquant and mx -------------------------------------------------------------------

# SPEC §10.1's slot sizes at D = 128 and key bits, the oracle of the bytes formula.
TQ_SLOT_128 = {"turboquant_k8v4": (196, 8), "turboquant_4bit_nc": (134, 4),
               "turboquant_k3v4_nc": (118, 3), "turboquant_3bit_nc": (102, 3)}


@pytest.mark.skipif(not HAS_TURBOQUANT, reason=NEEDS_45)
def test_turboquant_tiny_run_checks_every_preset_and_counts_its_bytes(capsys, tmp_path):
    """Every preset and the fp8 write are checked against the torch reference and measured; the
    bytes are SPEC §10.6's formulas; vLLM's store is a row of its own, unsupported without vLLM
    (or timed once where it runs)."""
    js = tmp_path / "t.json"
    assert main([*TINY["turboquant"], "--kinds", "turboquant,fp8,vllm", "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["rows"]
    H, D, e = 2, 128, 2  # bfloat16 inputs; the random pattern has no padding (n = T)
    seen = set()
    for r in rows:
        preset, T = r["kv_cache_dtype"], r["num_tokens"]
        if r["kind"] == "vllm":
            assert r["status"].startswith("unsupported: ") or r["status"] == "ok", r
            continue
        assert r["status"] == "ok" and r["check"] == "passed", r
        slot, b = TQ_SLOT_128[preset]
        tables = 4 * D * D + 4 * (2**b - 1) if b != 8 else 0
        want = (T * H * 2 * D * e + T * H * slot + T * 8 + tables if r["kind"] == "turboquant"
                else T * H * 2 * D * (e + 1) + T * 8)
        assert r["bytes"] == want, r
        seen.add((r["kind"], preset))
    assert seen == {(k, p) for k in ("turboquant", "fp8") for p in TQ_SLOT_128}
    out = capsys.readouterr().out
    assert "slot_size: turboquant_k8v4 196, turboquant_4bit_nc 134" in out
    assert "its bytes are not checked" in out


@pytest.mark.skipif(not HAS_MX, reason=NEEDS_45)
def test_mx_tiny_run_checks_every_mode_rule_and_layout_and_counts_its_bytes(tmp_path):
    js = tmp_path / "m.json"
    argv = [*TINY["mx"], "--head-size", "128", "--block-size", "128", "--num-blocks", "2",
            "--scale-rules", "ceil,floor", "--scale-layouts", "linear,interleaved128", "--json",
            str(js)]
    assert main(argv) == 0
    rows = json.loads(js.read_text())["rows"]
    H, D, e = 2, 128, 2
    row = {"mxfp8": D + D // 32, "mxfp4": D // 2 + D // 32}
    seen = set()
    for r in rows:
        assert r["status"] == "ok" and r["check"] == "passed", r
        T, mode = r["num_tokens"], r["kv_cache_dtype"]
        want = (T * H * 2 * D * e + T * H * 2 * row[mode] + T * 8 if r["kind"] == "mx"
                else T * H * 2 * D * (e + 1) + T * 8)
        assert r["bytes"] == want, r
        seen.add((r["kind"], mode, r["scale_rule"], r["scale_layout"]))
    assert len(seen) == 2 * 2 * 2 * 2


def test_a_kind_the_definition_does_not_compare_is_timed_with_check_skipped(monkeypatch,
                                                                          tmp_path):
    """engine.UNCHECKED (turboquant's vllm kind: another library's bytes) is neither a mismatch
    nor a pass: the row is measured and says check "skipped"."""
    defn = _bench("nvfp4")
    monkeypatch.setattr(defn, "check", lambda ctx, kind, impl: (
        engine.UNCHECKED if kind == "fp8" else None))
    js = tmp_path / "u.json"
    assert main([*TINY["nvfp4"], "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["rows"]
    assert rows and all(r["status"] == "ok" for r in rows)
    assert {r["kind"]: r["check"] for r in rows} == {"fp8": "skipped", "nvfp4": "passed"}


def _wrong_writes(monkeypatch, name: str):
    """``kvwrite.<name>`` as the reference, but implementation "wrong" also flips one byte of
    the last cache argument's allocation (a byte no correct write changes, or one it wrote)."""
    real = getattr(kvwrite, name)

    def wrong(*args, implementation=None, **kwargs):
        real(*args, implementation="torch", **kwargs)
        if implementation == "wrong":
            caches = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                      and a.dtype == torch.uint8]
            last = caches[-1]
            idx = (last.dim() - 1) * (-1,) + (0,)
            last[idx] = torch.bitwise_not(last[idx])
    monkeypatch.setattr(kvwrite, name, wrong)


@pytest.mark.skipif(not (HAS_TURBOQUANT and HAS_MX), reason=NEEDS_45)
@pytest.mark.parametrize("sub, kind", [("turboquant", "turboquant"), ("mx", "mx"),
                                       ("turboquant", "fp8")])
def test_new_checks_catch_a_byte_written_wrong(monkeypatch, sub, kind):
    """The check compares whole allocations: one byte flipped anywhere in the cache (or, for mx,
    the last scale cache) fails it; the reference itself passes."""
    defn = _bench(sub)
    _, _, points, _ = engine.configure(defn, TINY[sub][1:], sub)
    point = [p for p in points if p.num_tokens == 16][-1]
    ctx = defn.prepare(point, 1, torch.device("cpu"))
    assert defn.check(ctx, kind, "torch") is None
    name = "reshape_and_cache_flash" if kind in ("fp8", "mx") else "reshape_and_cache_turboquant"
    _wrong_writes(monkeypatch, name)
    assert defn.check(ctx, kind, "wrong") is not None
    assert defn.check(ctx, kind, "torch") is None


class _Clock:
    """A fake device timeline for the overlap's events: every stub call advances it."""

    now = 0.0  # ms

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = _Clock.now

        def elapsed_time(self, end) -> float:
            return end.t - self.t

        def synchronize(self):
            pass


def _fake_overlap(monkeypatch, drift: float):
    """A transfer bench whose overlap runs on a fake timeline: the attention takes 1 ms alone and
    1.1 ms while a transfer (6.5 ms) is in flight, both times growing by ``drift`` a call (a
    clock that slows over the series). Overlap needs CUDA: the events, streams and attention are
    stubbed."""
    import contextlib

    from kvwrite.bench.ops import transfer as tr

    _Clock.now = 0.0
    state = {"overlapping": False, "scale": 1.0}
    defn = tr.TransferBench()
    p = tr.Point(16, "llama3-8b", "bf16", "d2h", "swap", "", "", "sm", 4, True, False, 2)
    alone = iter([1e-3, 6.5e-3])  # _event_time: the attention alone, then the transfer alone
    monkeypatch.setattr(tr, "_event_time", lambda fn: next(alone))
    monkeypatch.setattr(torch.cuda, "Event", _Clock.Event)

    def joined(other):  # the main stream waits for the side one: the transfer is over
        state["overlapping"] = False

    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(wait_stream=joined))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    def attention(q, k, v, is_causal):
        _Clock.now += state["scale"] * (1.1 if state["overlapping"] else 1.0)
        state["scale"] *= 1 + drift

    def transfer(i):
        state["overlapping"] = True
        _Clock.now += 6.5

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", attention)
    side = types.SimpleNamespace(wait_stream=lambda other: None)
    defn._attention = ((None, None, None), side)
    call = defn._overlapped({"point": p, "device": torch.device("cpu")}, transfer)
    return defn, p, call


def test_transfer_overlap_reports_attention_per_call(monkeypatch):
    """The overlapped attention is the repeated sequence over its repeat count, so it compares
    with one call alone: alone 1 ms, a 6.5 ms transfer -> 7 repeats; overlapped at 1.1 ms a call
    the row says 1100 µs (not 7700) and a slowdown of 1.10. Nothing is reported for a series
    that was not timed."""
    defn, p, call = _fake_overlap(monkeypatch, drift=0.0)
    assert defn.params(p).get("attention_slowdown") is None
    for i in range(3):
        call(i)
    got = defn.params(p)
    assert got["attention_repeat"] == 7
    assert got["attention_us"] == pytest.approx(1000)
    assert got["attention_overlapped_us"] == pytest.approx(1100)
    assert got["attention_slowdown"] == pytest.approx(1.1)
    assert got["attention_slowdown_low"] == pytest.approx(1.1)
    assert got["attention_slowdown_high"] == pytest.approx(1.1)
    assert got["transfer_overlapped_us"] == pytest.approx(6500)
    assert defn.params(p) == got  # measured once: the params of a series do not run it again


def test_transfer_overlap_slowdown_cancels_clock_drift(monkeypatch):
    """A clock that slows 1% a call over the series: the attention alone measured once before
    the timed calls would make the slowdown about 1.4; the rounds taken in turn keep it at 1.10
    (the drift within a round cancels between its two orders; the rounds' extremes show it)."""
    defn, p, call = _fake_overlap(monkeypatch, drift=0.01)
    for i in range(20):
        call(i)
    got = defn.params(p)
    assert got["attention_slowdown"] == pytest.approx(1.1, rel=2e-3)
    assert got["attention_slowdown_low"] < 1.05 and got["attention_slowdown_high"] > 1.15


@pytest.mark.xfail(not HAS_TRANSFER, reason="needs the transfer ops", strict=True)
def test_transfer_report_is_one_line_per_point_against_the_limit(capsys, tmp_path):
    """The report of a transfer JSON: a table per model, cache and limit, one line per point
    (the block counts and series are columns, not tables), every figure GB/s with its % of the
    direction's limit (not of the device copy bandwidth) and the host time."""
    js = tmp_path / "t.json"
    assert main([*TINY["transfer"], "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["rows"]
    capsys.readouterr()
    assert main(["report", str(js)]) == 0
    md = capsys.readouterr().out
    assert "copy bandwidth" not in md
    command, head, table = md.strip().split("\n\n")  # one table: one model, cache and limit
    assert head.startswith("**transfer: model=llama3-8b") and "limit=d2h" in head
    body = table.splitlines()
    points = {(r["operation"], r["page_format"], r["engine"]) for r in rows}
    lines = body[2:]
    assert len(lines) == len(points) == 4  # swap sm, swap torch, pack raw sm, pack fp8 sm
    cols = [c.strip() for c in body[0].strip("|").split("|")]
    for r in rows:
        line = next(ln for ln in lines if [c.strip() for c in ln.strip("|").split("|")][:3] == [
            r["operation"], r["page_format"], r["engine"]])
        cells = dict(zip(cols, (c.strip() for c in line.strip("|").split("|")), strict=True))
        at = f"blocks {r['num_tokens']} {r['implementation']}"
        pct = 100 * r["gbps"] / r["limit_gbps"]
        assert cells[f"{at} GB/s (% limit)"] == f"{r['gbps']:.1f} ({pct:.0f}%)"
        assert cells[f"{at} host µs"] == f"{r['host_us']:.0f}"


def test_qk_norm_rope_model_on_the_cpu_runs(capsys):
    argv = ["qk-norm-rope", "--device", "cpu", "--model", "qwen3-30b-a3b", "--num-tokens", "2",
            "--kinds", "fused", "--iters", "2", "--graph-calls", "1", "--time-budget", "0.01"]
    assert main(argv) == 0
    assert "qwen3-30b-a3b (Hq,Hk,D)=(32,4,128)" in capsys.readouterr().out


def test_qk_norm_rope_fp8_scales_are_a_param_where_asked_for(tmp_path):
    """--fp8-scales sets the fp8 caches' k_scale and v_scale (powers of two take the CUDA
    kernels' one-product path): a param of the fp8 rows then, none of the auto rows' nor of a
    run at the defaults (0.05, 0.04), whose rows keep the committed identity."""
    base = ["qk-norm-rope", "--device", "cpu", "--heads", "4,2,32", "--num-tokens", "2",
            "--kinds", "fused", "--iters", "2", "--graph-calls", "1", "--time-budget", "0.01",
            "--kv-cache-dtypes", "fp8_e4m3,auto"]
    for extra, want in (([], None), (["--fp8-scales", "1,0.5"], [1.0, 0.5])):
        out = tmp_path / f"{len(extra)}.json"
        assert main(base + extra + ["--json", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        assert {r["kv_cache_dtype"]: r.get("fp8_scales") for r in rows} == {
            "fp8_e4m3": want, "auto": None}, rows


def test_write_fp8_scales_set_the_inputs_scales_and_are_a_param(tmp_path):
    """The write benchmark's --fp8-scales K,V: every k_scale K and every v_scale V (per tensor, or
    each head's), a param of the rows; without it amax / 64 (vLLM's recipe) and no such param, so
    the committed rows keep their identity."""
    bench = _bench("reshape_and_cache_flash")
    base = [*TINY["reshape_and_cache_flash"], "--kv-cache-dtype", "fp8", "--iters", "2",
            "--time-budget", "0.01"]
    for extra, want in (([], None), (["--fp8-scales", "1,0.5"], [1.0, 0.5]),
                        (["--fp8-scales", "2,0.25", "--per-head-scale"], [2.0, 0.25])):
        out = tmp_path / f"{len(extra)}.json"
        assert main(base + extra + ["--json", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        assert rows and all(r.get("fp8_scales") == want for r in rows), rows
        _, _, points, _ = engine.configure(bench, base + extra, "kvwrite-bench")
        point = points[0]
        _, _, sets = bench.prepare(point, 2, torch.device("cpu"))
        heads = point.case.num_heads if "--per-head-scale" in extra else 1
        for s in sets:
            assert s.k_scale.numel() == heads and s.v_scale.numel() == heads
            if want is None:
                assert torch.equal(s.k_scale, (s.key.amax() / 64).float().reshape(s.k_scale.shape))
            else:
                assert (s.k_scale == want[0]).all() and (s.v_scale == want[1]).all()


@pytest.mark.parametrize("argv", [["--implementation", "all"], ["rope"], []])
def test_no_gpu_is_one_short_line_before_the_implementations(monkeypatch, capsys, argv):
    # As on a machine where no implementation is available without a GPU (--implementation all
    # then listed every implementation's reason in one 996-character line).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(registry.ImplInfo, "available",
                        lambda self, device: "needs a GPU" if str(device).startswith("cuda")
                        else None)
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU is visible" in lines[0] and "--device cpu" in lines[0]
    assert len(lines[0]) < 250, lines[0]


def test_nothing_measured_is_exit_status_3(monkeypatch, capsys):
    defn = _bench("reshape_and_cache_flash")
    monkeypatch.setattr(type(defn), "unsupported", lambda self, ctx, kind, impl: "not here")
    assert main(TINY["reshape_and_cache_flash"]) == engine.NOTHING_MEASURED == 3
    assert "nothing was measured" in capsys.readouterr().err


@pytest.mark.parametrize("sub, argv", [
    ("rope", ["--model", "qwen3-8b", "--slots", "mixed"]),
    ("rope", ["--model", "llama-3.1-8b", "--slots", "decode"]),
    ("qk-norm-rope", ["--model", "qwen3-8b", "--slots", "mixed", "--num-tokens", "512"]),
    ("reshape_and_cache_flash", ["--model", "llama-3.1-8b", "--slots", "decode"]),
    ("reshape_and_cache_flash", ["--model", "qwen3-8b", "--slots", "mixed"]),
    ("per-token-head", ["--model", "llama-3.1-8b", "--slots", "decode"]),
])
def test_model_serving_shapes_size_the_cache_for_every_point(sub, argv):
    """--model with a sequence pattern: every point's slots are built in its cache (the decode
    sequences' blocks counted), so no point is skipped; configure refuses any that would be."""
    from kvwrite.testing.slots import make_slots

    defn = _bench(sub)
    _, _, points, _ = engine.configure(defn, ["--device", "cpu", *argv], sub)
    assert max(p.num_tokens for p in points) >= 256
    for p in points:
        c = getattr(p, "case", p)
        make_slots(c.slots, p.num_tokens, c.num_blocks, c.block_size)  # raises where it misfits


def test_threads_flag_sets_and_the_header_says_them(capsys):
    before = torch.get_num_threads()
    try:
        assert main([*TINY["reshape_and_cache_flash"], "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert re.search(r"^# CPU threads: 1 ", out, re.M), out


def test_version(capsys):
    from kvwrite import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kvwrite-bench {__version__}\n"
    with pytest.raises(SystemExit) as e:
        main(["rope", "--version"])
    assert e.value.code == 0 and __version__ in capsys.readouterr().out


def test_progress_lines_carry_an_eta(capsys):
    assert engine.eta(10.0, 2, 6) == ", ETA 0:20" and engine.eta(1.0, 6, 6) == ""
    assert engine.eta(3600.0, 1, 3) == ", ETA 2:00:00"
    assert main(TINY["reshape_and_cache_flash"]) == 0
    progress = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[")]
    assert all(", ETA " in ln for ln in progress[:-1]) and ", ETA" not in progress[-1]


def test_rope_header_defines_its_columns(capsys):
    assert main(TINY["rope"]) == 0
    out = capsys.readouterr().out
    assert "bound" in out.split("\n# launch")[-1]  # the column
    assert re.search(r"^# columns: .*bound = pair bytes / fused bytes", out, re.M)


def _figure_of(monkeypatch, rows):
    import matplotlib.figure

    from kvwrite.bench.plot import plot_rows

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot_rows(rows, "unused.png")
    return saved[0]


def test_plot_marks_skipped_points_draws_the_band_and_plain_ticks(monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.collections import PathCollection, PolyCollection

    from kvwrite.bench.plot import tick_label
    from kvwrite.bench.report import Row

    rows = [Row(op="x", kind="x", implementation=i, num_tokens=t, params={"layout": "NHD"},
                latency_us=math.nan if (i, t) == ("b", 64) else 0.5 + t / 100,
                p20_us=0.45 + t / 100, p80_us=0.6 + t / 100, gbps=float(t))
            for i in ("a", "b") for t in (1, 4, 16, 64)]
    fig = _figure_of(monkeypatch, rows)
    lat_ax, bw_ax = fig.axes[:2]
    bands = [c for c in lat_ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 2  # one p20-p80 band per series
    for ax in (lat_ax, bw_ax):
        marks = [c for c in ax.collections if isinstance(c, PathCollection)]
        assert len(marks) == 1 and [x for x, _ in marks[0].get_offsets()] == [64]
    assert [tick_label(v) for v in (0.6, 1, 2, 40, 1024, 0.05, 2.5)] == [
        "0.6", "1", "2", "40", "1024", "0.05", "2.5"]
    fig.canvas.draw()
    labels = [t.get_text() for ax in (lat_ax, bw_ax) for t in
              ax.get_yticklabels() + ax.get_yticklabels(minor=True) + ax.get_xticklabels()]
    assert labels and not any("e" in t or "\\times" in t or "^" in t for t in labels), labels


def _python(code: str) -> str:
    """What ``code`` prints, run by a fresh Python that imports this checkout's kvwrite."""
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_cli_imports_no_op_and_no_engine_until_a_subcommand_runs():
    """What makes --help and --version quick and Ctrl-C during start-up one line: importing the
    command line imports no op's benchmark and not the engine."""
    code = ("import sys, kvwrite.bench.cli as c; "
            "print(sorted(m for m in sys.modules if m.startswith('kvwrite.bench.') or "
            "m.endswith('.bench')))")
    out = _python(code)
    assert out.strip() == "['kvwrite.bench', 'kvwrite.bench.cli']", out


def test_importing_the_command_line_imports_no_torch_and_version_needs_none():
    """The console script imports kvwrite.bench.cli (and so kvwrite) before main() runs: neither
    may import PyTorch, or Ctrl-C while it loads is a traceback and --version waits for it; the
    first public name of kvwrite imports the ops (registering them)."""
    code = ("import sys, kvwrite, kvwrite.bench.cli as c; t0 = 'torch' in sys.modules; "
            "rc = c.main(['--version']); t1 = 'torch' in sys.modules; "
            "n = len(kvwrite.implementations()); print(t0, t1, rc, n > 30, 'torch' in sys.modules)")
    out = _python(code)
    assert out.split()[-5:] == ["False", "False", "0", "True", "True"], out


def test_ctrl_c_while_starting_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "bench_of", interrupted)
    assert main(["rope", "--device", "cpu"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err and "Traceback" not in err


def test_an_unknown_subcommand_is_one_line(capsys):
    assert main(["nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# --- outputs -----------------------------------------------------------------------------------

def test_output_paths_are_really_created_then_removed(tmp_path):
    # /proc/x.json: os.access says yes to root; creating it does not.
    with pytest.raises(ValueError, match="cannot be written"):
        engine.check_output_path("--json", "/proc/x.json")
    fresh = tmp_path / "r.json"
    engine.check_output_path("--json", str(fresh))
    assert not fresh.exists()  # the probe file is removed again
    kept = tmp_path / "old.json"
    kept.write_text("keep me")
    engine.check_output_path("--json", str(kept))
    assert kept.read_text() == "keep me"  # an existing file is neither removed nor truncated


@pytest.mark.parametrize("sub", SUBS)
def test_ctrl_c_keeps_what_was_measured_in_every_subcommand(ctrl_c_at_third_measurement, capsys,
                                                           tmp_path, sub):
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    assert main([*TINY[sub], "--json", str(js), "--csv", str(cs)]) == 130
    out, err = capsys.readouterr()
    assert "interrupted (Ctrl-C) after 2 of" in err and "Traceback" not in err
    assert "latency (µs)" in out or "(µs)" in out  # the table of what was measured
    assert len(json.loads(js.read_text())["rows"]) == 2
    assert cs.read_text().count("\n") == 3


@pytest.mark.parametrize("sub", SUBS)
def test_report_and_plot_read_every_subcommands_json(capsys, tmp_path, sub):
    js = tmp_path / "r.json"
    assert main([*TINY[sub], "--json", str(js)]) == 0
    capsys.readouterr()
    assert main(["report", str(js)]) == 0
    md = capsys.readouterr().out
    command = re.sub(r" --json \S+", "", json.loads(js.read_text())["meta"]["command"])
    assert md.startswith(f"`{command}`\n\n**{_bench(sub).name}: ")
    if _bench(sub).report_split is None:
        assert "| T |" in md and re.search(r"^\| 16 \| [0-9.]+ \(", md, re.M)
    else:  # a line per point, the block counts as columns (test_transfer_report_...)
        assert re.search(r"^\| .* \| [0-9.]+ \([0-9]+%\) \|", md, re.M)
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    assert main(["plot", str(js), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tables_print_microseconds_the_same_way(capsys):
    for sub in SUBS:
        assert main(TINY[sub]) == 0
        out = capsys.readouterr().out
        assert "(µs)" in out and "(us)" not in out, sub


@pytest.mark.parametrize("sub", SUBS)
def test_cpu_header_says_what_the_cpu_run_measured(capsys, sub):
    assert main(TINY[sub]) == 0
    out = capsys.readouterr().out
    assert "# CPU timings: host clock" in out and "# L2: not controlled on the CPU" in out
    assert "timer: device" not in out and "launch floor" not in out


# --- the CPU defaults --------------------------------------------------------------------------

@pytest.mark.parametrize("sub", SUBS)
def test_cpu_defaults_are_a_small_sweep(sub):
    """The default run on a CPU moves a few MB per point (vLLM's shapes would need a 64 GiB
    cache, or minutes of the torch reference): the work is bounded, not timed."""
    defn = _bench(sub)
    cfg, _, points, _ = engine.configure(defn, ["--device", "cpu"], sub)
    moved = sum(defn.bytes(p, k) for p in points for k in cfg.kinds)
    assert moved * len(cfg.implementations) <= 64 * 2**20
    assert max(defn.state_bytes(p) + defn.temp_bytes(p) for p in points) <= 1.5 * 2**30
    assert cfg.iters * cfg.graph_calls <= 50 and cfg.implementations == ["torch"]


@pytest.mark.parametrize("sub", SUBS)
def test_cpu_default_runs_end_to_end(capsys, sub):
    assert main([*_sub_argv(sub), "--device", "cpu"]) == 0
    assert "(µs)" in capsys.readouterr().out


# --- optional packages -------------------------------------------------------------------------

def test_without_triton_every_message_says_it_is_not_installed():
    code = """
import sys
sys.modules["triton"] = None  # `import triton` fails, as where it is not installed
import torch, kvwrite
from kvwrite.bench.cli import main
from kvwrite.bench.models import MODELS
from tools.probes import main as probe
reasons = [s.reason for s in kvwrite.implementations("cpu") if s.name == "triton"]
print("REASONS", reasons)
try:
    kvwrite.reshape_and_cache_flash(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8),
        torch.zeros(1, 16, 1, 8), torch.zeros(1, 16, 1, 8), torch.zeros(1, dtype=torch.long),
        "auto", None, None, implementation="triton")
except ValueError as e:
    print("CALL", e)
print("PROBE", probe(["variants"]))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, ROOT]), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    out = done.stdout + done.stderr
    reasons = re.search(r"REASONS (.*)", out).group(1)
    assert reasons.count("triton is not installed (pip install triton)") == len(registry.ops())
    assert "cannot import name" not in out
    assert re.search(r"CALL .*triton is not installed \(pip install triton\)", out)
    assert "PROBE 2" in out and "needs triton, which is not installed" in out
    assert "Traceback" not in out


# --- sanitize cases for every op ----------------------------------------------------------------

def test_every_op_with_cuda_kernels_has_sanitize_cases():
    cases = sanitize.op_cases()
    assert set(cases) == {op for op in registry.ops()
                          if any(i.name == "cuda" for i in registry.all_impls(op))}
    for op, got in cases.items():
        ids = [i for i, _ in got]
        assert ids and len(set(ids)) == len(ids), op


@pytest.mark.parametrize("module", ["rotary_embedding", "fused_rope_and_reshape_cache_flash",
                                    "concat_and_cache_mla"])
def test_sanitize_cases_build_and_match_on_the_cpu(monkeypatch, module):
    """Each case's inputs are valid and the comparison passes for the reference itself; a
    deliberately wrong implementation (the last slot skipped) is caught."""
    import importlib
    mod = importlib.import_module(f"tools.sanitize.{module}")
    small = [c for c in mod.CASES if c.num_tokens < 1000]
    for case in small:
        assert mod.run_case(case, "cpu", "torch") is None, case.id
    if module == "rotary_embedding":
        return  # rotary_embedding has no slots; its wrong writers are caught in test_rope
    from kvwrite.ops.concat_and_cache_mla import OP as MLA
    from kvwrite.ops.fused_rope_and_reshape_cache_flash import OP as FUSED
    op = {"concat_and_cache_mla": MLA, "fused_rope_and_reshape_cache_flash": FUSED}[module]
    ref = registry.get(op, "torch")
    wrong = types.ModuleType("kvwrite_test_wrong_writer")  # the slots reversed
    wrong.available = lambda device: None
    wrong.unsupported = lambda *a: None

    def run(*args, **kwargs):
        args = list(args)
        slots_at = 3 if op == MLA else 8
        args[slots_at] = args[slots_at].flip(0)  # each token into another token's slot
        ref.run(*args, **kwargs)

    wrong.run = run
    monkeypatch.setitem(sys.modules, wrong.__name__, wrong)
    monkeypatch.setitem(registry._REGISTRY, (op, "wrong"),
                        registry.ImplInfo(op, "wrong", "slots reversed", wrong.__name__,
                                          priority=-1, devices=("cpu",)))
    for case in small:
        assert mod.run_case(case, "cpu", "wrong") is not None, case.id


def test_sanitize_without_a_gpu_is_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert sanitize.main([]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert sanitize.main(["--ops", "nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# --- issue 46: --direction p2p (cuda:0 <-> cuda:1) -------------------------------------------------

P2P_ARGV = ["transfer", "--model", "llama3-8b", "--layers", "2", "--direction", "p2p",
            "--num-tokens", "2,16", "--engine", "sm,ce", "--max-ctas", "4,all"]


@pytest.mark.xfail(not HAS_TRANSFER, reason="needs the transfer ops", strict=True)
@pytest.mark.parametrize("gpus", [0, 1])
def test_p2p_with_fewer_than_two_gpus_is_one_line_and_exit_2(no_bench_work, capsys, monkeypatch,
                                                             gpus):
    # The default --device cuda: refused before the no-GPU check and before any work, naming
    # --direction and how many GPUs PyTorch sees.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(SystemExit) as e:
        main(P2P_ARGV)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvwrite-bench transfer: error: --direction "
                                                   "p2p:"), lines
    assert f"needs 2 CUDA GPUs; PyTorch sees {gpus}" in lines[0], lines


@pytest.mark.xfail(not HAS_TRANSFER, reason="needs the transfer ops", strict=True)
def test_p2p_from_another_device_is_refused(no_bench_work, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as e:
        main([*P2P_ARGV, "--device", "cuda:1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--direction p2p" in err and "cuda:1" in err


@pytest.mark.xfail(not HAS_TRANSFER, reason="needs the transfer ops", strict=True)
def test_p2p_points_both_ways(monkeypatch):
    # With 2 GPUs: swap and relayout (each target) and the handoff (each page format), both ways;
    # the SM budget sweep and ce (raw only), the peers of swap; no overlap points; every row's
    # limit is the peer copy of its own way.
    import argparse

    from kvwrite.bench.ops import transfer as tb

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    parser = engine.build_parser(tb.BENCH, "t")
    args = parser.parse_args(engine.normalize_flags(P2P_ARGV[1:]))
    assert isinstance(args, argparse.Namespace)
    args.explicit = engine.given_flags(parser, P2P_ARGV[1:])
    args.num_tokens = " ".join(args.num_tokens)
    tb.BENCH.configure(args, torch.device("cuda"))
    args.token_counts = engine.parse_num_tokens(args.num_tokens)
    points = tb.BENCH.points(args)
    assert {p.direction for p in points} == {"p2p:0to1", "p2p:1to0"}
    assert {p.op for p in points} == {"swap", "relayout", "handoff"}
    assert not any(p.overlap for p in points)
    assert {p.limit for p in points if p.direction == "p2p:1to0"} == {"p2p:1to0"}
    swap = {(p.engine, p.max_ctas) for p in points if p.op == "swap"}
    assert swap == {("sm", 4), ("sm", None), ("ce", None), ("vllm-loop", None),
                    ("batch", None), ("torch", None)}
    assert {p.page_format for p in points if p.op == "handoff" and p.engine == "ce"} == {"raw"}
    assert tb._side_devices(points[0], torch.device("cuda")) == (
        torch.device("cuda", 0), torch.device("cuda", 1))


def test_sigterm_keeps_what_was_measured(monkeypatch, capsys, tmp_path):
    """SIGTERM (`timeout`'s, a scheduler's) mid-sweep stops the run as Ctrl-C does: the points
    measured so far are printed and written; the caller's SIGTERM handler comes back after."""
    import os
    import signal

    real = engine._measure
    calls = []

    def measure(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_measure", measure)
    before = signal.getsignal(signal.SIGTERM)
    js = tmp_path / "r.json"
    assert main([*TINY[SUBS[0]], "--json", str(js)]) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C) after 2 of" in err and "Traceback" not in err
    assert len(json.loads(js.read_text())["rows"]) == 2
    assert signal.getsignal(signal.SIGTERM) is before
