"""kvwrite-bench's seed subcommand (reshape_and_cache_flash): vLLM's flags and function, the
table/JSON/CSV schema, the check, errors, plots. The engine's behaviour across every subcommand
is tests/test_engine.py."""

import csv
import inspect
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

from kvwrite import registry
from kvwrite.bench import engine, run_benchmark
from kvwrite.bench.cli import main
from kvwrite.bench.engine import parse_num_tokens
from kvwrite.bench.models import MODELS
from kvwrite.bench.ops import reshape_and_cache_flash as seed_bench
from kvwrite.bench.report import COMMON_FIELDS, Row
from kvwrite.ops.reshape_and_cache_flash import OP
from kvwrite.ops.reshape_and_cache_flash import reference as torch_ref
from kvwrite.testing import Case

SEED_HEADER = re.compile(r"^Benchmark results for implementation (\S+) \(measuring with (\S+)\):$",
                         re.M)
SEED_COLUMNS = re.compile(r"^\s*num_tokens\s+layout\s+latency \(µs\)$", re.M)

# A tiny sweep that runs end to end on the CPU in well under a second.
TINY = ["--num-tokens", "2,16", "--num-heads", "2", "--head-size", "64", "--num-blocks", "64",
        "--iters", "3"]
CPU_TINY = ["--device", "cpu", *TINY]
BENCH = seed_bench.BENCH
SEED_PARAMS = ["layout", "dtype", "kv_cache_dtype", "num_heads", "head_size", "block_size",
               "num_blocks", "per_head_scale", "model", "tp", "slots", "slot_params",
               "pad_fraction"]
ROW_FIELDS = ["op", "kind", "implementation", "num_tokens", *SEED_PARAMS,
              *COMMON_FIELDS[4:]]
CSV_FIELDS = [*ROW_FIELDS, "command"]


def configure(argv: list[str]):
    """(config, args, points) of the seed subcommand's flags."""
    cfg, args, points, _ = engine.configure(BENCH, argv, "kvwrite-bench")
    return cfg, args, points


def _table_rows(out: str) -> list[list[str]]:
    """The data lines of the table under vLLM's header line."""
    lines = out[SEED_HEADER.search(out).end():].strip("\n").splitlines()
    body = []
    for line in lines[2:]:
        if not line or line.startswith(("notes", "speedup", " ")) and not line.strip()[0].isdigit():
            break
        body.append(line.split())
    return body


# --- vLLM's flags and function --------------------------------------------------------------------

# vLLM's benchmark: vLLM's flag, its default, and its choices (None: any int).
SEED_FLAGS = {
    "--num-heads": (128, None),
    "--head-size": (128, [64, 80, 96, 112, 120, 128, 192, 256]),
    "--block-size": (16, [16, 32]),
    "--num-blocks": (128 * 512, None),
    "--dtype": ("bfloat16", ["half", "bfloat16", "float"]),
    "--kv-cache-dtype": ("auto", ["auto", "fp8"]),
    "--iters": (100, None),
    "--implementation": ("cuda", ["cuda", "triton"]),
    "--mode": ("cudagraph", ["cudagraph", "no_graph"]),
}


def test_seed_flags_defaults_and_choices():
    actions = engine.build_parser(BENCH, "kvwrite-bench")._option_string_actions
    for flag, (default, choices) in SEED_FLAGS.items():
        action = actions[flag]
        assert action.default == default, flag
        if flag in ("--kv-cache-dtype",):
            assert set(choices) <= set(action.choices), flag  # fp8_e5m2 added
        elif flag == "--implementation":
            for name in choices:  # any registered name, a list or 'all': checked after parsing
                assert configure([flag, name])[0].implementations == [name]
        elif choices is None:
            assert action.choices is None and action.type is int, flag
        else:
            assert list(action.choices) == choices, flag
    # vLLM's parser also takes underscores.
    assert configure(["--num_heads", "8", "--head_size=64"])[1].num_heads == 8


def test_seed_defaults_make_the_seed_sweep():
    cfg, args, points = configure([])
    assert cfg.implementations == ["cuda"] and cfg.mode == "cudagraph" and cfg.iters == 100
    assert [p.case.layout_name for p in points] == ["NHD"] * 16 + ["HND"] * 16
    assert [p.num_tokens for p in points[:16]] == [2**e for e in range(1, 17)]
    c = points[0].case
    assert (c.num_heads, c.head_size, c.block_size, c.num_blocks) == (128, 128, 16, 65536)
    assert c.dtype == torch.bfloat16 and c.kv_cache_dtype == "auto"


def test_help_lists_every_seed_flag(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in SEED_FLAGS:
        assert flag in out


def test_run_benchmark_signature():
    params = inspect.signature(run_benchmark).parameters
    assert list(params) == ["num_tokens", "num_heads", "head_size", "block_size", "num_blocks",
                            "dtype", "kv_cache_dtype", "kv_cache_layout", "num_iters",
                            "implementation", "benchmark_mode", "device"]
    assert params["device"].default == "cuda"
    assert all(p.default is inspect.Parameter.empty for n, p in params.items() if n != "device")


def test_run_benchmark_on_cpu():
    args = dict(num_tokens=16, num_heads=2, head_size=64, block_size=16, num_blocks=64,
                dtype=torch.bfloat16, kv_cache_dtype="auto", kv_cache_layout="HND", num_iters=3,
                implementation="torch", benchmark_mode="no_graph", device="cpu")
    seconds = run_benchmark(**args)
    assert math.isfinite(seconds) and 0 < seconds < 1
    with pytest.raises(ValueError, match="cudagraph"):
        run_benchmark(**{**args, "benchmark_mode": "cudagraph"})
    with pytest.raises(ValueError, match="head_size"):  # vLLM's rule for fp8
        run_benchmark(**{**args, "kv_cache_dtype": "fp8", "head_size": 120})
    with pytest.raises(ValueError, match="num_tokens"):
        run_benchmark(**{**args, "num_tokens": 64 * 16 + 1})
    with pytest.raises(ValueError, match="implementation"):
        run_benchmark(**{**args, "implementation": "nope"})


# --- the CPU run end to end ----------------------------------------------------------------------

def test_cpu_end_to_end_table_json_csv_plot(tmp_path, capsys):
    js, cs, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
    plot = ["--plot", str(png)] if _has_matplotlib() else []
    assert main([*CPU_TINY, "--json", str(js), "--csv", str(cs), *plot]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert SEED_HEADER.search(out).groups() == ("torch", "no_graph")
    assert SEED_COLUMNS.search(out)
    assert "CPU timings" in out
    body = _table_rows(out)
    assert [(r[0], r[1]) for r in body] == [("2", "NHD"), ("16", "NHD"), ("2", "HND"), ("16", "HND")]
    assert all(float(r[2]) > 0 for r in body)
    assert "[4/4]" in captured.err  # progress goes to stderr

    doc = json.loads(js.read_text())
    assert doc["meta"]["command"].startswith("kvwrite-bench ")
    assert doc["meta"]["argv"][:2] == ["--device", "cpu"]
    rows = doc["rows"]
    assert len(rows) == 4
    for r in rows:
        assert set(r) == set(ROW_FIELDS)
        assert r["status"] == "ok" and r["check"] == "passed" and r["timer"] == "cpu"
        assert r["bytes"] == 2 * r["num_tokens"] * 2 * 64 * (2 + 2) + r["num_tokens"] * 8
        assert r["median_us"] > 0 and r["p20_us"] <= r["median_us"] <= r["p80_us"]
        assert math.isclose(r["gbps"], r["bytes"] / r["median_us"] / 1e3)
    with cs.open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_FIELDS
        lines = list(reader)
    assert len(lines) == 4 and lines[0]["command"] == doc["meta"]["command"]

    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        again = tmp_path / "again.png"
        assert main(["plot", str(js), "--out", str(again)]) == 0
        assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_layouts_fp8_e5m2_per_head_and_host_sync_on_cpu(tmp_path, capsys):
    js = tmp_path / "r.json"
    argv = [*CPU_TINY, "--layouts", "packed,HND", "--kv-cache-dtype", "fp8_e5m2",
            "--per-head-scale", "--timer", "host-sync", "--json", str(js), "--verbose"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "timer: host-sync" in out
    assert re.search(r"latency \(µs\)\s+p20 \(µs\)\s+p80 \(µs\)\s+GB/s\s+% copy BW\s+status", out)
    rows = json.loads(js.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["packed", "packed", "HND", "HND"]
    assert all(r["status"] == "ok" and r["check"] == "passed" for r in rows)
    assert all(r["timer"] == "host-sync" and r["bytes"] % 2 == 0 for r in rows)


@pytest.mark.parametrize("argv, flag", [
    # fp8 needs head_size % 16 == 0 (vLLM's rule).
    (["--num-tokens", "2", "--head-size", "120", "--kv-cache-dtype", "fp8"], "--head-size"),
    # 2048 tokens exceed 64 blocks * 16 slots.
    (["--num-tokens", "2,2048"], "--num-blocks"),
])
def test_points_that_cannot_run_are_refused_before_the_sweep(monkeypatch, capsys, argv, flag):
    monkeypatch.setattr(engine, "measure_env", lambda *a: pytest.fail("work started"))
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--num-heads", "2", "--num-blocks", "64", *argv])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "cannot run" in lines[0], lines


def test_seed_script_runs_from_a_checkout(tmp_path):
    """benchmarks/kernels/... finds src/ itself when kvwrite (here: a stale one) lacks the bench."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "kvwrite").mkdir()
    (tmp_path / "kvwrite" / "__init__.py").write_text("")
    script = root / "benchmarks" / "kernels" / "benchmark_reshape_and_cache_flash.py"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script), *CPU_TINY, "--layouts", "NHD"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert SEED_HEADER.search(done.stdout).groups() == ("torch", "no_graph")


# --- the check ------------------------------------------------------------------------------------

def _register(monkeypatch, name: str, run) -> None:
    mod = types.ModuleType(f"kvwrite_test_impl_{name}")
    mod.available = lambda device: None
    mod.unsupported = lambda key, key_cache, cache_dtype, k_scale, v_scale: None
    mod.run = run
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(registry._REGISTRY, (OP, name),
                        registry.ImplInfo(OP, name, "deliberately wrong", mod.__name__,
                                          priority=-1))


def _skip_last(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale):
    torch_ref.run(key, value, key_cache, value_cache, slot_mapping[:-1], cache_dtype, k_scale, v_scale)


def _stray(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale):
    """Right rows, plus token 0's value row also in a slot of the same block no token owns."""
    torch_ref.run(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale)
    bs = key_cache.shape[1]
    taken = set(slot_mapping.tolist())
    s0 = int(slot_mapping[0])
    free = next(s for s in range(s0 - s0 % bs, s0 - s0 % bs + bs) if s not in taken)
    value_cache[free // bs, free % bs] = value[0].to(value_cache.dtype)


@pytest.mark.parametrize("broken", [_skip_last, _stray])
def test_check_marks_a_wrong_implementation(monkeypatch, capsys, tmp_path, broken):
    _register(monkeypatch, "wrong", broken)
    js = tmp_path / "r.json"
    rc = main([*CPU_TINY, "--implementation", "torch,wrong", "--json", str(js)])
    assert rc == 1  # a failed check fails the run
    out = capsys.readouterr().out
    assert SEED_HEADER.search(out).group(1) == "torch,wrong"
    assert re.search(r"torch \(µs\)\s+wrong \(µs\)\s+wrong vs torch", out)
    rows = json.loads(js.read_text())["rows"]
    by_impl = {i: [r for r in rows if r["implementation"] == i] for i in ("torch", "wrong")}
    assert all(r["status"] == "ok" and r["median_us"] > 0 for r in by_impl["torch"])
    for r in by_impl["wrong"]:
        assert r["status"].startswith("mismatch: ") and r["check"] == "failed"
        assert r["median_us"] is None and r["samples"] == 0  # never timed
    assert "wrong NHD num_tokens 2: mismatch: " in out
    stray = "a slot no token writes" in out
    assert stray == (broken is _stray)


def test_no_check_times_without_checking(monkeypatch, tmp_path):
    _register(monkeypatch, "wrong", _skip_last)
    js = tmp_path / "r.json"
    assert main([*CPU_TINY, "--implementation", "wrong", "--no-check", "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["rows"]
    assert all(r["check"] == "skipped" and r["status"] == "ok" for r in rows)


# --- errors ---------------------------------------------------------------------------------------

def test_no_gpu_without_device_cpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(TINY) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--device cpu" in err


@pytest.mark.parametrize("argv, flag", [
    (["--num-heads", "8", "--tp", "3"], "--tp"),
    (["--model", "llama-3.1-8b", "--tp", "3"], "--tp"),
    (["--model", "no-such-model"], "--model"),
    (["--model", "llama-3.1-8b", "--num-heads", "4"], "--model"),
    (["--num-tokens", "0,2"], "--num-tokens"),
    (["--num-tokens", "64:2"], "--num-tokens"),
    (["--layouts", "NHD,XYZ"], "--layouts"),
    (["--implementation", "cuda,nope"], "--implementation"),
    (["--implementation", "torch", "--baseline", "cuda"], "--baseline"),
    (["--head-size", "100"], "--head-size"),
])
def test_bad_flags_name_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", *argv])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_models_and_tp():
    for name, preset in MODELS.items():
        args = configure(["--model", name])[1]
        assert (args.num_heads, args.head_size) == (preset.num_kv_heads, preset.head_dim)
    assert (MODELS["llama-3.1-8b"].num_kv_heads, MODELS["llama-3.1-8b"].head_dim) == (8, 128)
    assert (MODELS["gemma-2-9b"].num_kv_heads, MODELS["gemma-2-9b"].head_dim) == (8, 256)
    assert (MODELS["gpt-oss-120b"].num_kv_heads, MODELS["gpt-oss-120b"].head_dim) == (8, 64)
    assert configure(["--model", "Llama-3.1-8B", "--tp", "2"])[1].num_heads == 4
    assert configure(["--model", "llama-3.1-8b", "--tp", "8"])[1].num_heads == 1
    assert configure(["--model", "llama-3.1-8b", "--tp", "16"])[1].num_heads == 1
    assert configure(["--num-heads", "128", "--tp", "4"])[1].num_heads == 32


def test_sample_count_without_a_time_budget():
    # time_device's default budget is infinite: then every one of `iters` samples is taken.
    from kvwrite.bench.timing import MIN_SAMPLES, _sample_count
    assert _sample_count(1e-5, 30, math.inf) == 30
    assert _sample_count(1e-3, 100, 0.05) == max(MIN_SAMPLES, 50)
    assert _sample_count(0.0, 7, 1.0) == 7


def test_time_cpu_stops_at_its_budget_when_runs_slow_down(monkeypatch):
    # A fake clock: every call takes 1 ms more than the one before. The sample count planned from
    # the first runs would overrun the budget many times; the timer stops once it is spent.
    from kvwrite.bench import timing
    clock = {"now": 0.0, "calls": 0}

    def call(i):
        clock["calls"] += 1
        clock["now"] += 1e-3 * clock["calls"]

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    t = timing.time_cpu(call, calls=1, iters=1000, budget_s=0.05)
    assert len(t.samples) == timing.MIN_SAMPLES  # the budget is spent before the 10th sample
    clock.update(now=0.0, calls=0)
    t = timing.time_cpu(call, calls=1, iters=1000, budget_s=1.0)
    spent = sum(t.samples)
    assert spent > 1.0 and spent - t.samples[-1] <= 1.0  # stopped at the first sample past it


def test_parse_num_tokens():
    assert parse_num_tokens("2:65536") == [2**e for e in range(1, 17)]
    assert parse_num_tokens("3:20") == [3, 6, 12]
    assert parse_num_tokens("1,2,64,2") == [1, 2, 64]
    for bad in ("", "a", "0", "4:2", "1:2:3", "-1"):
        with pytest.raises(ValueError, match="--num-tokens"):
            parse_num_tokens(bad)


def test_cache_too_large_names_the_largest_num_blocks(monkeypatch, capsys):
    free = int(1.25 * 2**30)
    monkeypatch.setattr(engine, "available_memory", lambda device: free)
    assert main(["--device", "cpu", *TINY[:-4], "--num-blocks", "10000000", "--iters", "3"]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "Traceback" not in err
    largest = int(re.search(r"largest --num-blocks that fits is (\d+)", err).group(1))
    block_bytes = 2 * 16 * 2 * 64 * 2  # K + V of one block, bf16
    assert largest > 0 and largest * block_bytes < free
    # The suggested size runs under the same memory limit.
    assert main(["--device", "cpu", *TINY[:-4], "--num-blocks", str(largest), "--iters", "3"]) == 0
    monkeypatch.setattr(engine, "available_memory", lambda device: 0)
    assert main(CPU_TINY) == 2
    assert "No --num-blocks fits" in capsys.readouterr().err


def test_out_of_memory_is_a_message_not_a_traceback(monkeypatch, capsys):
    def oom(*args, **kwargs):
        raise engine.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(seed_bench, "make_caches", oom)
    assert main(CPU_TINY) == 2
    err = capsys.readouterr().err
    assert "out of device memory" in err and "--num-blocks" in err and "Traceback" not in err


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert main([*CPU_TINY, "--plot", str(tmp_path / "p.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err


# --- what a first run on a machine without a GPU meets -------------------------------------------

def test_cpu_defaults_are_a_small_shape_and_given_flags_win():
    cfg, args, points = configure(["--device", "cpu"])
    assert (args.num_heads, args.num_blocks, cfg.iters, cfg.graph_calls) == (8, 16, 10, 5)
    assert args.token_counts == parse_num_tokens(BENCH.cpu_defaults["num_tokens"])
    shape = points[0].case
    assert shape.cache_bytes <= 2**20 and max(args.token_counts) <= shape.num_slots
    cfg, given, _ = configure(["--device", "cpu", "--num-heads", "4", "--num-blocks", "99",
                               "--num-tokens", "3", "--iters", "7", "--graph-calls", "2"])
    assert (given.num_heads, given.num_blocks, given.token_counts, cfg.iters,
            cfg.graph_calls) == (4, 99, [3], 7, 2)
    model = configure(["--device", "cpu", "--model", next(iter(MODELS))])[1]
    assert model.num_heads == MODELS[next(iter(MODELS))].num_kv_heads
    # On a GPU, vLLM's defaults stay.
    cfg, gpu, _ = configure([])
    assert (gpu.num_heads, gpu.num_blocks, cfg.iters) == (128, 128 * 512, 100)


def test_memory_check_comes_before_the_copy_bandwidth(monkeypatch, capsys):
    def measured(*args):
        raise AssertionError("copy bandwidth measured before the memory check")

    monkeypatch.setattr(engine, "available_memory", lambda device: 0)
    monkeypatch.setattr(engine.timing, "copy_bandwidth", measured)
    assert main(CPU_TINY) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "copy bandwidth" not in err


@pytest.mark.parametrize("flag", ["--json", "--csv", "--plot"])
def test_output_paths_are_checked_before_the_sweep(monkeypatch, capsys, tmp_path, flag):
    def sweep_ran(*args, **kwargs):
        raise AssertionError("the sweep ran")

    monkeypatch.setattr(engine, "sweep", sweep_ran)
    missing = tmp_path / "no-such-folder" / "out.x"
    with pytest.raises(SystemExit) as e:
        main([*CPU_TINY, flag, str(missing)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: the folder" in err and "does not exist" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main([*CPU_TINY, flag, str(tmp_path)])
    assert f"{flag}: expected a file path, got the folder" in capsys.readouterr().err


def test_plot_out_path_and_a_file_that_is_not_json_are_named(capsys, tmp_path):
    notjson = tmp_path / "notjson.json"
    notjson.write_text("hello")
    with pytest.raises(SystemExit) as e:
        main(["plot", str(notjson), "--out", str(tmp_path / "p.png")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{notjson}: expected a JSON file written by --json" in err
    assert "Expecting value" in err  # the parser's own words follow the file's name
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path / "other.json"), "--out", str(tmp_path / "p.png")])
    assert f"{tmp_path / 'other.json'}: expected a kvwrite-bench JSON file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path / "absent.json"), "--out", str(tmp_path / "p.png")])
    assert f"{tmp_path / 'absent.json'}: cannot read it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plot", str(notjson), "--out", str(tmp_path / "nope" / "p.png")])
    assert "--out: the folder" in capsys.readouterr().err


def test_ctrl_c_prints_and_writes_what_was_measured(ctrl_c_at_third_measurement, capsys,
                                                    tmp_path):
    calls = ctrl_c_at_third_measurement
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    argv = [*CPU_TINY, "--json", str(js), "--csv", str(cs)]  # 2 layouts x 2 token counts
    assert main(argv) == 130
    out, err = capsys.readouterr()
    assert [r[:2] for r in _table_rows(out)] == [["2", "NHD"], ["16", "NHD"]]
    assert "interrupted (Ctrl-C) after 2 of 4 measurements" in err and "Traceback" not in err
    assert len(json.loads(js.read_text())["rows"]) == 2
    assert len(list(csv.DictReader(cs.open()))) == 2
    # Before the first point: a message, no table, the same exit status.
    calls.clear()
    calls.extend([1, 1])
    assert main(CPU_TINY) == 130
    out, err = capsys.readouterr()
    assert "before any point was measured" in err and "Benchmark results" not in out


def test_nothing_that_can_run_is_an_error_not_a_nan_table(capsys):
    assert main([*CPU_TINY, "--implementation", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert "nothing can run on cpu: cuda: " in err and "Benchmark results" not in out


def test_all_on_cpu_says_what_it_leaves_out_and_why(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main([*CPU_TINY, "--implementation", "all", "--num-tokens", "2"]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("--implementation all leaves out")]
    assert any("triton" in ln and "TRITON_INTERPRET=1" in ln for ln in lines), err
    assert any(ln.startswith("--implementation all leaves out cuda: ") for ln in lines), err


# --- pieces ---------------------------------------------------------------------------------------

def test_rotation_exceeds_the_l2_or_flushes():
    cfg = configure([])[0]  # device cuda: a torch.device needs no GPU
    l2 = 50 * 2**20
    for heads in (8, 128):
        for t in (2**e for e in range(1, 17)):
            shape = Case.named_layout("NHD", num_tokens=t, num_heads=heads, head_size=128,
                                      num_blocks=65536)
            point = seed_bench.Point(shape)
            sets, flush = engine.rotation(BENCH, cfg, point, l2)
            assert 1 <= sets <= cfg.graph_calls
            total = sets * shape.set_bytes(t)
            assert total >= 2 * l2 or (flush[OP] and sets == cfg.graph_calls)
            assert (total - shape.set_bytes(t) < 2 * l2) or sets == 1  # no more sets than needed
    cfg.hot_l2 = True
    assert engine.rotation(BENCH, cfg, seed_bench.Point(shape), l2) == (1, {OP: False})


def test_all_means_the_implementations_available_on_the_device():
    cfg = configure(["--device", "cpu", "--implementation", "all"])[0]
    assert "torch" in cfg.implementations
    assert all(registry.get(OP, n).available("cpu") is None for n in cfg.implementations)
    assert cfg.baseline == cfg.implementations[0]


def test_seed_table_is_vllms_format():
    # vLLM's layout (tabulate's "simple" format, f"{latency_us:.3f}" cells), the numbers printed
    # fixed-point as formatted: tabulate's own re-reading printed 1005980.123 as 1.00598e+06.
    rows = [sweep_row(2, "NHD", 3.05), sweep_row(65536, "HND", 2406.981),
            sweep_row(131072, "NHD", 1005980.123), sweep_row(16, "HND", float("nan"))]
    cfg = configure(["--device", "cpu"])[0]
    assert engine.table(BENCH, rows, cfg) == (
        "  num_tokens  layout      latency (µs)\n"
        "------------  --------  --------------\n"
        "           2  NHD                3.050\n"
        "       65536  HND             2406.981\n"
        "      131072  NHD          1005980.123\n"
        "          16  HND                  nan")


def sweep_row(num_tokens: int, layout: str, latency_us: float):
    return Row(op=OP, kind=OP, implementation="torch", num_tokens=num_tokens,
               params={"layout": layout, "dtype": "bfloat16"}, latency_us=latency_us)


# --- on the GPU -----------------------------------------------------------------------------------

GPU_SMALL = ["--num-heads", "8", "--num-blocks", "4096", "--iters", "20", "--time-budget", "0.1"]


@pytest.mark.gpu
def test_gpu_all_implementations_check_and_time(tmp_path, capsys):
    js = tmp_path / "r.json"
    argv = [*GPU_SMALL, "--implementation", "all", "--layouts", "all",
            "--num-tokens", "2,64,4096", "--json", str(js), "--verbose"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "timer: device" in out and "L2: rotated" in out
    assert "--implementation all leaves out torch: not CUDA-graph safe" in err
    doc = json.loads(js.read_text())
    impls = doc["meta"]["implementations"]
    assert len(impls) >= 2
    assert "torch" not in impls  # not graph-safe: 'all' leaves it out and says why
    for r in doc["rows"]:
        assert r["status"] == "ok" and r["check"] == "passed", r
        assert r["median_us"] > 0 and r["gbps"] > 0 and r["pct_copy_bw"] > 0
        if r["num_tokens"] == 2:  # 8 KiB sets: all 20 calls of a graph get their own
            assert r["rotation_sets"] == 20
    assert doc["meta"]["copy_bw_gbps"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_gpu_fp8_no_graph_and_host_sync(tmp_path, kv):
    js = tmp_path / "r.json"
    argv = [*GPU_SMALL, "--implementation", "all", "--kv-cache-dtype", kv, "--per-head-scale",
            "--mode", "no_graph", "--num-tokens", "16,1024", "--json", str(js)]
    assert main(argv) == 0
    assert main([*argv[:-2], "--timer", "host-sync", "--hot-l2"]) == 0
    rows = json.loads(js.read_text())["rows"]
    # kvwrite's own (torch included) are measured and checked; a peer may say why it cannot run.
    own = [r for r in rows if r["implementation"] in ("cuda", "triton", "torch")]
    assert len(own) == 3 * 4
    assert all(r["status"] == "ok" and r["check"] == "passed" for r in own)
    assert all(r["status"] == "ok" and r["check"] == "passed" or r["status"].startswith("unsupported")
               for r in rows)


@pytest.mark.gpu
def test_gpu_check_catches_a_wrong_implementation(monkeypatch, tmp_path):
    _register(monkeypatch, "wrong", _skip_last)
    js = tmp_path / "r.json"
    argv = [*GPU_SMALL, "--implementation", "wrong", "--num-tokens", "16,4096", "--json", str(js)]
    assert main(argv) == 1
    rows = json.loads(js.read_text())["rows"]
    assert all(r["status"].startswith("mismatch") and r["median_us"] is None for r in rows)


@pytest.mark.gpu
def test_gpu_run_benchmark():
    args = dict(num_tokens=256, num_heads=8, head_size=128, block_size=16, num_blocks=1024,
                dtype=torch.bfloat16, kv_cache_dtype="auto", num_iters=10,
                benchmark_mode="cudagraph")
    for info in (i for i in registry.all_impls(OP) if i.available("cuda") is None):
        impl = info.name
        for layout in ("NHD", "HND", "packed", "HND-packed", "LBHNC"):
            seconds = run_benchmark(**args, kv_cache_layout=layout, implementation=impl)
            if not info.graph_safe:  # torch, torch-compile: they sync with the host
                assert math.isnan(seconds)
            else:
                assert math.isfinite(seconds) and seconds > 0


@pytest.mark.gpu
def test_gpu_cache_too_large(monkeypatch, capsys):
    # Room for the inputs, the L2 rotation and flush buffers, but not for 10^8 blocks.
    monkeypatch.setattr(engine, "available_memory", lambda device: 4 * 2**30)
    assert main([*GPU_SMALL[:2], "--num-tokens", "2:1024", "--num-blocks", "100000000"]) == 2
    assert "largest --num-blocks that fits is" in capsys.readouterr().err


# --- slot patterns ---------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", [
    ["--slots", "decode"],
    ["--slots", "prefill", "--prefill-len", "8", "--pad-fraction", "0.25"],
    ["--slots", "mixed", "--decode-fraction", "0.5", "--context-len", "100"],
])
def test_slot_pattern_flags_end_to_end_on_cpu(tmp_path, capsys, pattern):
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    argv = ["--device", "cpu", "--num-blocks", "256", "--num-heads", "8", "--num-tokens", "4,16",
            "--iters", "3", *pattern, "--json", str(js), "--csv", str(cs)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    kind = pattern[1]
    assert re.search(rf"^# slots: {kind}\b", out, re.M)
    doc = json.loads(js.read_text())
    assert doc["meta"]["header"] == [ln[2:] for ln in out.splitlines() if ln.startswith("# ")]
    rows = doc["rows"]
    assert len(rows) == 4
    pad = 0.25 if "--pad-fraction" in pattern else 0.0
    for r in rows:
        assert r["status"] == "ok" and r["check"] == "passed"
        assert r["slots"] == kind and r["slot_params"].startswith(kind) and r["pad_fraction"] == pad
        n = r["num_tokens"] - round(pad * r["num_tokens"])
        assert r["bytes"] == 2 * n * 8 * 128 * (2 + 2) + r["num_tokens"] * 8
    with cs.open() as f:
        assert {line["slots"] for line in csv.DictReader(f)} == {kind}


def test_slot_pattern_that_does_not_fit_is_refused_before_the_sweep(capsys):
    # 32 decode sequences need 32 blocks; the cache has 16.
    argv = ["--device", "cpu", "--num-blocks", "16", "--num-heads", "2", "--head-size", "64",
            "--num-tokens", "4,32", "--iters", "3", "--slots", "decode"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_tokens 32 with --slots decode needs 32 cache blocks" in err


@pytest.mark.parametrize("argv,flag", [
    (["--pad-fraction", "1"], "--pad-fraction"),
    (["--decode-fraction", "2"], "--decode-fraction"),
    (["--prefill-len", "0"], "--prefill-len"),
    (["--context-len", "-1"], "--context-len"),
])
def test_bad_slot_flags_name_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit):
        main(["--device", "cpu", *argv])
    assert flag in capsys.readouterr().err


# --- the launch floor in every benchmark's header -------------------------------------------------

FLOOR_ARGS = {
    "write": [*GPU_SMALL, "--implementation", "cuda", "--num-tokens", "2"],
    "rope": ["rope", "--num-tokens", "2", "--heads", "4,2,64", "--kv-cache-dtypes", "auto",
             "--dtypes", "bfloat16", "--layouts", "NHD", "--implementation", "cuda",
             "--iters", "10"],
    "mla": ["mla", "--num-tokens", "2", "--implementation", "cuda", "--iters", "10"],
}


# A small run of each benchmark subcommand on the CPU (torch implementation); test_pdl uses it too.
CPU_RUNS = {
    "write": ["--device", "cpu", "--num-tokens", "2", "--implementation", "torch", "--iters", "2"],
    "rope": ["rope", "--device", "cpu", "--num-tokens", "2", "--heads", "2,1,16",
             "--kv-cache-dtypes", "auto", "--dtypes", "float32", "--layouts", "NHD",
             "--implementation", "torch", "--iters", "2", "--num-blocks", "4"],
    "mla": ["mla", "--device", "cpu", "--num-tokens", "2", "--kv-lora-rank", "16", "--pe-dim",
            "8", "--num-blocks", "4", "--implementation", "torch", "--iters", "2"],
}


@pytest.mark.parametrize("sub", sorted(CPU_RUNS))
def test_cpu_runs_print_no_launch_floor(sub, capsys):
    assert main(CPU_RUNS[sub]) == 0
    assert "launch floor" not in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("sub", sorted(FLOOR_ARGS))
def test_gpu_header_and_json_carry_the_launch_floor(sub, tmp_path, capsys):
    """Each benchmark measures an empty kernel's time per call in the same run and prints it
    beside the copy bandwidth; the JSON's meta carries the same figure."""
    from kvwrite.kernels import nvrtc

    if nvrtc.setup_reason() is not None:
        pytest.skip(nvrtc.setup_reason())
    js = tmp_path / "r.json"
    assert main([*FLOOR_ARGS[sub], "--json", str(js)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "launch floor:" in ln]
    assert len(lines) == 1, lines
    printed = float(re.search(r"launch floor: ([0-9.]+) µs per call", lines[0]).group(1))
    meta = json.loads(js.read_text())["meta"]
    assert meta["launch_floor_us"] > 0 and f"{meta['launch_floor_us']:.2f}" == f"{printed:.2f}"
