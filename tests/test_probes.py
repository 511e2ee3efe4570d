"""The repository's tools (``python -m tools.probes``, ``python -m tools.sanitize``) and
kvwrite-bench's report subcommand: argument parsing, the --set parser, the
markdown report of a CPU benchmark's JSON, the A/B loader (an earlier revision as its own
package), the probes' kernels compiled with NVRTC, and on a GPU the probes and the sanitizer
cases themselves."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import kvwrite
import tools
import tools.sanitize as sanitize
from kvwrite.bench import cli, markdown, timing
from kvwrite.bench.report import read_json
from kvwrite.layouts import KVAlloc, Layout
from kvwrite.ops.reshape_and_cache_flash import cuda_impl, triton_impl
from kvwrite.testing import Case, make_inputs
from sass import needs_nvrtc
from tools import probes
from tools.probes import PROBES, ab, common, small_t
from tools.sanitize import reshape_and_cache_flash as seed_sanitize

SRC = os.path.dirname(os.path.dirname(os.path.abspath(kvwrite.__file__)))
PKG = os.path.dirname(os.path.abspath(kvwrite.__file__))
ROOT = os.path.dirname(os.path.abspath(tools.__path__[0]))  # the checkout: tools/ is not installed
BASE_REV = "b3301bf"  # the last revision before the op axis (kvwrite.impls, registry.get(name))


def _git_reason(rev: str) -> str | None:
    """None when the tree kvwrite is imported from is a git checkout that has ``rev``."""
    if shutil.which("git") is None:
        return "git is not installed"
    try:
        subprocess.run(["git", "-C", SRC, "cat-file", "-e", f"{rev}^{{tree}}"], check=True,
                       capture_output=True)
    except subprocess.CalledProcessError:
        return f"{SRC} is not a git checkout holding revision {rev}"
    return None


needs_history = pytest.mark.skipif(_git_reason(BASE_REV) is not None,
                                   reason=str(_git_reason(BASE_REV)))


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")


def tool(argv: list[str]) -> int:
    """``python -m tools.<argv[0]> <argv[1:]>`` (``probes`` or ``sanitize``), in this process."""
    return {"probes": probes.main, "sanitize": sanitize.main}[argv[0]](argv[1:])


# ------------------------------------------------------------------------------------------
# Argument parsing
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["probes", name, "--help"] for name in PROBES]
                         + [["sanitize", "--help"], ["probes", "--help"]])
def test_every_tool_has_help(argv, capsys):
    try:
        rc = tool(argv)
    except SystemExit as e:  # argparse's --help
        rc = e.code
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m tools." + " ".join(argv[:-1]))


def test_report_has_help(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's --help
        cli.main(["report", "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvwrite-bench report")


@pytest.mark.parametrize("word, where", [("probe", "python -m tools.probes NAME"),
                                         ("sanitize", "python -m tools.sanitize")])
def test_moved_subcommands_say_where_they_went(word, where, capsys):
    # Tools of the repository, not of kvwrite's users: kvwrite-bench names the command instead.
    assert cli.main([word, "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and where in err, err
    assert cli.main(["--help"]) == 0  # the help names the command too
    assert where in capsys.readouterr().out


@pytest.mark.parametrize("module", ["tools.probes", "tools.sanitize"])
def test_tools_run_as_documented_from_the_checkout(module):
    # `python -m tools.probes NAME` / `python -m tools.sanitize` from the checkout's root, with
    # kvwrite installed or on PYTHONPATH (CONTRIBUTING.md).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [SRC] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    res = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(f"usage: python -m {module}")


def test_probe_without_a_name_lists_the_probes(capsys):
    assert tool(["probes"]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in PROBES)


def test_unknown_probe_is_one_line_naming_it(capsys):
    assert tool(["probes", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'nope'" in err and "variants" in err


@no_gpu
@pytest.mark.parametrize("argv", [["probes", "variants"], ["probes", "pattern"],
                                  ["probes", "small-t"], ["probes", "ab", "--base", "HEAD"],
                                  ["probes", "l2-follow"], ["sanitize"],
                                  ["probes", "mla"], ["probes", "mla-pattern"],
                                  ["probes", "chain"], ["probes", "pdl-step"]])
def test_gpu_probes_say_so_plainly_on_cpu(argv, capsys):
    assert tool(argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert "\n" not in err and "needs a CUDA GPU" in err, err
    assert "Traceback" not in cap.err + cap.out


@pytest.mark.parametrize("argv, flag", [
    (["probes", "small-t", "--heads", "8,x"], "--heads"),
    (["probes", "small-t", "--layouts", "NHD,XYZ"], "--layouts"),
    (["probes", "small-t", "--pad", "3"], "--pad"),
    (["probes", "variants", "--impls", "cuda,nope"], "--impls"),
    (["probes", "variants", "--impls", "cuda,torch"], "--impls: torch cannot be captured"),
    (["probes", "small-t", "--impls", "torch"], "--impls: torch cannot be captured"),
    (["probes", "variants", "--filter", "no-such-point"], "--filter"),
    (["probes", "pattern", "--kinds", "plain,odd"], "--kinds"),
    (["probes", "l2-follow", "--points", "8-XYZ-fp8-64"], "--points"),
    (["probes", "ab", "--base", "HEAD", "--layouts", "NHD,nope"], "--layouts"),
    (["probes", "ab", "--base", "HEAD", "--kv", "fp9"], "kv_cache_dtype"),
    (["probes", "mla-pattern", "--tokens", "0"], "--tokens"),
    (["probes", "mla-pattern", "--tokens", "200000"], "--tokens"),
    (["probes", "mla-pattern", "--modes", "fp9"], "kv_cache_dtype"),
    (["probes", "mla-pattern", "--impls", "cuda,torch"], "--impls"),
    (["probes", "chain", "--sets", "0"], "--sets"),
    (["probes", "chain", "--sets", "21"], "--sets"),
    (["probes", "pdl-step", "--tokens", "0"], "--tokens"),
    (["probes", "pdl-step", "--tokens", "70000"], "--tokens"),
    (["probes", "pdl-step", "--impls", "cuda,torch"], "--impls"),
    (["probes", "pdl-step", "--replays", "0"], "--replays"),
    (["probes", "tq-pattern", "--kinds", "pattern,odd"], "--kinds"),
    (["probes", "tq-pattern", "--presets", "turboquant_2bit"], "--presets"),
])
def test_bad_arguments_are_one_line_naming_the_flag(argv, flag, capsys):
    # Checked before anything needs a GPU, so the same on every machine.
    assert tool(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err, err


def test_timers_without_a_budget_take_every_sample():
    # The probes' timer passes no time budget (math.inf): every requested sample is taken.
    t = timing.time_cpu(lambda i: None, 2, 7)
    assert len(t.samples) == 7 and t.calls == 2


# ------------------------------------------------------------------------------------------
# --set IMPL.FIELD=V1|V2
# ------------------------------------------------------------------------------------------
def test_set_parses_each_alternative_with_the_fields_type():
    assert common.parse_set("triton.tile_bytes=4096|0x2000|16_384") == (
        "triton", "tile_bytes", [4096, 8192, 16384])
    impl, field, values = common.parse_set("cuda.loop_free=true|False|1|0")
    assert (impl, field) == ("cuda", "loop_free")
    assert values == [True, False, True, False] and all(type(v) is bool for v in values)
    assert common.parse_set("triton.evict_first_max_bytes=-1") == (
        "triton", "evict_first_max_bytes", [-1])


@pytest.mark.parametrize("text, words", [
    ("cuda.no_such_field=1", ["cuda", "'no_such_field'", "max_threads"]),
    ("nope.tile_bytes=1", ["'nope'", "cuda", "triton"]),
    ("cuda.max_threads=many", ["cuda.max_threads", "int", "'many'"]),
    ("cuda.loop_free=yes", ["cuda.loop_free", "true, false", "'yes'"]),
    ("cuda.max_threads", ["IMPL.FIELD=VALUE"]),
    ("max_threads=128", ["IMPL.FIELD=VALUE"]),
    ("cuda.max_threads=", ["IMPL.FIELD=VALUE"]),
])
def test_set_errors_name_what_is_wrong(text, words):
    with pytest.raises(common.ProbeError) as e:
        common.parse_set(text)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_variants_are_every_combination_of_new_tuning_objects():
    vs = common.variants(["cuda.max_threads=128|256", "triton.tile_bytes=4096|8192|16384"])
    assert len(vs) == 6
    seen = {(v.tunings["cuda"].max_threads, v.tunings["triton"].tile_bytes) for v in vs}
    assert seen == {(c, t) for c in (128, 256) for t in (4096, 8192, 16384)}
    for v in vs:
        assert isinstance(v.tunings["cuda"], cuda_impl.CudaTuning)
        assert v.tunings["cuda"] is not cuda_impl.TUNING
        # Fields not set keep the defaults.
        assert v.tunings["cuda"].small_row_threads == cuda_impl.TUNING.small_row_threads
    # The module-level defaults are untouched.
    assert cuda_impl.TUNING.max_threads == 256 and triton_impl.TUNING.tile_bytes == 4096
    v = vs[0]
    assert v.label == "cuda.max_threads=128,triton.tile_bytes=4096"
    assert v.tag("cuda") == "cuda[max_threads=128]" and v.tag("torch") == "torch"
    [plain] = common.variants([])
    assert plain.label == "" and plain.tunings["cuda"] is cuda_impl.TUNING


def test_impl_call_passes_the_variants_tuning(monkeypatch):
    seen = []
    [v] = common.variants(["cuda.max_threads=64"])
    monkeypatch.setattr(cuda_impl, "run", lambda *a, **kw: seen.append((a, kw)))
    common.impl_call("cuda", (1, 2), v)()
    assert seen == [((1, 2), {"tuning": v.tunings["cuda"]})]
    assert seen[0][1]["tuning"].max_threads == 64


# ------------------------------------------------------------------------------------------
# report: the markdown tables of a CPU benchmark's JSON
# ------------------------------------------------------------------------------------------
def test_report_renders_a_cpu_benchmarks_json(tmp_path, capsys):
    path = str(tmp_path / "cpu.json")
    assert cli.main(["--device", "cpu", "--num-heads", "8", "--num-blocks", "64", "--num-tokens",
                     "2,4", "--iters", "3", "--json", path]) == 0
    capsys.readouterr()
    assert cli.main(["report", path, path]) == 0
    out = capsys.readouterr().out
    meta, rows = read_json(path)
    table = markdown.markdown_tables(meta, rows)
    assert out == f"{table}\n\n{table}\n"
    lines = table.splitlines()
    assert lines[:2] == [f"`{meta['command'].replace(' --json ' + path, '')}`", ""]
    lines = lines[2:]
    assert lines[0].startswith("**reshape_and_cache_flash: dtype=bfloat16 kv_cache_dtype=auto "
                               "num_heads=8 head_size=128 block_size=16 num_blocks=64 "
                               "slots=random** (cpu, copy bandwidth ")
    assert lines[2] == "| T | NHD torch | HND torch |"
    assert lines[3] == "|---:|---:|---:|"
    by = {(r.num_tokens, r.layout): r for r in rows}
    for line, t in zip(lines[4:], (2, 4), strict=True):
        cells = [f"{by[(t, lo)].median_us:.2f} ({by[(t, lo)].pct_copy_bw:.0f}%)"
                 for lo in ("NHD", "HND")]
        assert line == f"| {t} | " + " | ".join(cells) + " |"


def test_report_marks_rows_not_measured_and_rejects_bad_files(tmp_path, capsys):
    path = str(tmp_path / "cpu.json")
    assert cli.main(["--device", "cpu", "--num-blocks", "64", "--num-tokens", "2",
                     "--iters", "3", "--layouts", "NHD", "--json", path]) == 0
    meta, rows = read_json(path)
    rows[0] = dataclasses.replace(rows[0], status="error: broken")
    assert markdown.markdown_tables(meta, rows).splitlines()[-1] == "| 2 | n/a |"
    page = tmp_path / "page.md"
    page.write_text("# Performance\n\nmethod\n\n<!-- generated: below -->\nold tables\n")
    assert cli.main(["report", "--into", str(page), path]) == 0
    assert page.read_text() == ("# Performance\n\nmethod\n\n<!-- generated: below -->\n\n"
                                + markdown.markdown_tables(*read_json(path)) + "\n")
    (tmp_path / "plain.md").write_text("no marker\n")
    with pytest.raises(SystemExit):
        cli.main(["report", "--into", str(tmp_path / "plain.md"), path])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"something": 1}))
    capsys.readouterr()
    assert cli.main(["report", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bad.json" in err


# ------------------------------------------------------------------------------------------
# ab: an earlier tree as its own package
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def packages():
    """This tree loaded from its directory, and where the history is there, b3301bf and HEAD."""
    pkgs = {"dir": ab.load_package(PKG, "kvwrite_ab_dir")}
    if _git_reason(BASE_REV) is None:
        pkgs["old"] = ab.load_package(BASE_REV, "kvwrite_ab_old", repo=SRC)
        pkgs["head"] = ab.load_package("HEAD", "kvwrite_ab_head", repo=SRC)
    return pkgs


def _fp8_case_calls(pkgs: dict, case: Case):
    """Per package: a call of its torch implementation, with its own CacheDType, on ``case``."""
    inp = make_inputs(case, "cpu")
    calls = {"this tree": lambda: kvwrite.reshape_and_cache_flash(*inp.args(),
                                                                  implementation="torch")}
    for name, pkg in pkgs.items():
        cdt = pkg.cache_dtype(case.kv_cache_dtype)
        run = pkg.impl("torch").run
        calls[name] = (lambda run=run, cdt=cdt: run(inp.key, inp.value, inp.key_cache,
                                                    inp.value_cache, inp.slot_mapping, cdt,
                                                    inp.k_scale, inp.v_scale))
    return inp, calls


CASE = Case(num_tokens=9, num_heads=4, head_size=64, kv_cache_dtype="fp8", layout=Layout.HND,
            alloc=KVAlloc.INTERLEAVED, per_head_scale=True)


def test_ab_loads_a_directory_as_its_own_package(packages):
    pkg = packages["dir"]
    assert pkg.module.__name__ == "kvwrite_ab_dir" and pkg.module is not kvwrite
    assert pkg.label == "kvwrite"
    assert pkg.impl("torch").__name__ == "kvwrite_ab_dir.ops.reshape_and_cache_flash.reference"
    assert pkg.impl("cuda").__name__.startswith("kvwrite_ab_dir.")
    # Its enum is its own; this tree's op is still this tree's, its op has its own namespace.
    cdt = pkg.cache_dtype("fp8")
    assert type(cdt) is pkg.module.CacheDType and not isinstance(cdt, kvwrite.CacheDType)
    assert hasattr(torch.ops.kvwrite_ab_dir, "reshape_and_cache_flash")
    inp, calls = _fp8_case_calls({"dir": pkg}, CASE)
    assert ab.check_same_bytes(calls, inp.key_cache, inp.value_cache, inp.slot_mapping) is None


@needs_history
def test_ab_loads_the_revision_before_the_op_axis_and_head(packages):
    old, head = packages["old"], packages["head"]
    assert old.impl("torch").__name__ == "kvwrite_ab_old.impls.torch_ref"
    assert old.impl("cuda").__name__ == "kvwrite_ab_old.impls.cuda_impl"
    assert head.impl("torch").__name__ == "kvwrite_ab_head.ops.reshape_and_cache_flash.reference"
    cdt = old.cache_dtype("fp8")
    assert type(cdt) is old.module.dtypes.CacheDType
    assert type(cdt) is not head.module.dtypes.CacheDType and not isinstance(
        cdt, kvwrite.CacheDType)
    # The old parser refuses this tree's enum: only the base's own parser gives the base's enum.
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        old.module.dtypes.parse_kv_cache_dtype(kvwrite.CacheDType.FP8_E4M3)


@needs_history
@pytest.mark.parametrize("case", [
    CASE,
    Case(num_tokens=7, num_heads=2, head_size=32, kv_cache_dtype="auto", alloc=KVAlloc.PACKED),
    Case(num_tokens=5, num_heads=3, head_size=16, dtype=torch.float32, kv_cache_dtype="fp8_e5m2"),
], ids=lambda c: c.id)
def test_ab_torch_implementations_of_old_head_and_this_tree_write_the_same_bytes(packages, case):
    inp, calls = _fp8_case_calls(packages, case)
    assert ab.check_same_bytes(calls, inp.key_cache, inp.value_cache, inp.slot_mapping) is None


def test_ab_byte_check_catches_a_wrong_implementation():
    inp = make_inputs(CASE, "cpu")

    def good():
        kvwrite.reshape_and_cache_flash(*inp.args(), implementation="torch")

    def off_by_one_slot():  # writes each row one slot further on
        kvwrite.reshape_and_cache_flash(*inp.args()[:4], (inp.slot_mapping + 1) % 16,
                                        *inp.args()[5:], implementation="torch")

    def one_bit():
        good()
        blk, pg = int(inp.slot_mapping[3]) // 16, int(inp.slot_mapping[3]) % 16
        inp.value_cache[blk, pg, 1, 5] ^= 1

    diff = ab.check_same_bytes({"good": good, "one_bit": one_bit}, inp.key_cache,
                               inp.value_cache, inp.slot_mapping)
    assert diff == "one_bit wrote 1 bytes other than good"
    assert ab.check_same_bytes({"good": good, "off": off_by_one_slot}, inp.key_cache,
                               inp.value_cache, inp.slot_mapping) is not None


def test_ab_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(common.ProbeError, match="holds no kvwrite package"):
        ab.load_package(str(tmp_path), "kvwrite_ab_empty")
    with pytest.raises(common.ProbeError, match="other than kvwrite"):
        ab.load_package(PKG, "kvwrite")
    with pytest.raises(common.ProbeError, match="already imported"):
        ab.load_package(PKG, "pytest")
    if _git_reason(BASE_REV) is None:
        with pytest.raises(common.ProbeError, match="no-such-rev"):
            ab.load_package("no-such-rev", "kvwrite_ab_bad", repo=SRC)
    assert "kvwrite_ab_bad" not in sys.modules and "kvwrite_ab_empty" not in sys.modules


# ------------------------------------------------------------------------------------------
# The probes' kernels and the sanitizer cases
# ------------------------------------------------------------------------------------------
def _probe_kernel_names() -> list[str]:
    names = ["kvw_empty", "kvw_pattern<false>", "kvw_pattern<true>", "kvw_slot_store",
             "kvw_rope_chain", "kvw_rope_row_chain", "kvw_tq_pattern<1>", "kvw_tq_pattern<4>",
             "kvw_tq_row_pattern"]
    names += [small_t.kernel_name(h, lo, fp8, 64) for h in (8, 128) for lo in small_t.LAYOUTS
              for fp8 in (False, True)]
    return names


@needs_nvrtc
def test_nvrtc_compiles_every_probe_kernel_in_one_program():
    names = _probe_kernel_names()
    obj, _ = common.SOURCE.compile("sm_90", names)
    assert set(names) <= set(obj.symbol_mapping)
    # Every scalar argument is 64-bit (cuda.core passes Python ints as 8 bytes): the mangled
    # names list only pointers (P...) and long long (x).
    pattern = obj.symbol_mapping["kvw_pattern<false>"].decode()
    assert pattern.endswith("PKhS1_PhS2_PKxxxxxxxx"), pattern


def test_sanitize_cases_cover_both_kernels_and_the_hard_shapes():
    assert seed_sanitize.KERNELS == ("loop-free", "grid-stride")
    ids = [c.id for c in seed_sanitize.CASES]
    assert len(set(ids)) == len(ids)
    assert any(c.head_size % 8 for c in seed_sanitize.CASES)            # unaligned rows
    assert any(c.out_of_range_slots for c in seed_sanitize.CASES)
    assert any(c.alloc is KVAlloc.PACKED for c in seed_sanitize.CASES)
    assert any(c.block_size & (c.block_size - 1) for c in seed_sanitize.CASES)
    assert max(c.num_tokens for c in seed_sanitize.CASES) >= 40_000
    assert len(seed_sanitize.cases()) == 2 * len(seed_sanitize.CASES)


def _all_runs() -> int:
    return sum(len(c) for c in sanitize.op_cases().values())


@pytest.mark.gpu
def test_gpu_sanitize_cases_match_the_reference_in_process():
    lines = []
    runs, failures = sanitize.run_cases(out=lines.append)
    assert runs == _all_runs() and failures == 0, "\n".join(lines)


@pytest.mark.gpu
def test_gpu_sanitize_case_reports_a_wrong_kernel(monkeypatch):
    # A deliberately wrong launch (slot + 1) must show as a mismatch.
    real = cuda_impl.run

    def shifted(key, value, kc, vc, slots, *rest, **kw):
        real(key, value, kc, vc, slots + 1, *rest, **kw)

    monkeypatch.setattr(cuda_impl, "run", shifted)
    diff = seed_sanitize.run_case(seed_sanitize.CASES[0], "loop-free")
    assert diff is not None and "bytes differ" in diff


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None,
                    reason="compute-sanitizer is not on PATH")
def test_gpu_sanitize_cases_under_compute_sanitizer():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [SRC] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--report-api-errors", "no",
           "--error-exitcode", "3", sys.executable, "-m", "tools.sanitize"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=540, cwd=ROOT)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    n = _all_runs()
    assert f"{n}/{n} runs match the torch reference" in out
    assert "ERROR SUMMARY: 0 errors" in out


@pytest.mark.gpu
@pytest.mark.parametrize("argv", [
    ["variants", "--impls", "cuda,triton", "--tokens", "2", "--filter", "8-128-HND-fp8",
     "--set", "cuda.small_chunk_bytes_fp8=8|16", "--replays", "3", "--blocks", "64"],
    ["pattern", "--kinds", "plain,evict_last", "--impls", "cuda", "--tokens", "64",
     "--filter", "128-128-NHD-auto,8-128-packed-fp8", "--replays", "3", "--blocks", "64"],
    ["small-t", "--heads", "8", "--tokens", "2", "--seeds", "2", "--replays", "3",
     "--blocks", "64"],
    ["l2-follow", "--points", "8-HND-fp8-64", "--follower-mib", "1", "--replays", "3",
     "--blocks", "64", "--set", "triton.evict_first_max_bytes=-1|0x100000"],
    ["ab", "--base", PKG, "--heads", "8", "--tokens", "2,64", "--kv", "auto,fp8",
     "--seeds", "2", "--replays", "3", "--blocks", "64"],
], ids=lambda a: a[0])
def test_gpu_probes_run_end_to_end(argv, tmp_path, capsys):
    path = str(tmp_path / "rows.json")
    assert tool(["probes", *argv, "--json", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ")
    with open(path) as f:
        doc = json.load(f)
    assert doc["rows"] and doc["meta"]["probe"] == argv[0]


@pytest.mark.gpu
def test_gpu_mla_pattern_probe_runs(capsys):
    assert tool(["probes", "mla-pattern", "--tokens", "1024", "--modes", "auto,fp8_ds_mla"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# ")
    assert [ln.split()[3] for ln in lines[1:]] == ["random", "sorted", "consecutive"] * 2
    # auto: cuda, triton and torch's index_copy_ (its 1152-byte entries need no padded view);
    # fp8_ds_mla: natural and 128B entries, cuda and triton.
    assert [ln.count("%)") for ln in lines[1:]] == [3] * 3 + [4] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("pieces", [1, 4, "row"])
@pytest.mark.parametrize("used, slot_alloc", [(196, 196), (134, 134), (134, 136)])
def test_gpu_tq_pattern_writes_the_slot_bytes_it_says_and_nothing_else(used, slot_alloc, pieces):
    """kvw_tq_pattern (and kvw_tq_row_pattern: "row") into vLLM's TurboQuant cache (heads
    outermost): unit i of row n's slot (4-byte words where every slot is 4-byte aligned, else
    halves) is n * 0x9E3779B1 ^ i; padding slots, the pad bytes and every other byte
    unchanged."""
    from tools.probes import tq_pattern

    T, H, D, nb, bs = 40, 3, 128, 8, 16
    torch.manual_seed(0)
    key = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
    value = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(nb * bs, device="cuda")[:T]
    slots[::7] = -1
    alloc = torch.randint(0, 256, (nb, H, bs, slot_alloc), dtype=torch.uint8, device="cuda")
    before = alloc.clone()
    if pieces == "row":
        tq_pattern.row_pattern_call(key, value, alloc.transpose(1, 2), slots, used, bs)()
    else:
        tq_pattern.pattern_call(key, value, alloc.transpose(1, 2), slots, used, bs, pieces)()
    torch.cuda.synchronize()
    unit = 4 if slot_alloc % 4 == 0 and used % 4 == 0 else 2
    i = torch.arange(used // unit, dtype=torch.int64)
    expect = before.clone()
    for t, s in enumerate(slots.tolist()):
        for h in range(H if s >= 0 else 0):
            tag = (t * H + h) * 0x9E3779B1 & 0xFFFFFFFF
            units = ((tag ^ i) & 0xFFFFFFFF).to(torch.int32).view(torch.uint8).view(-1, 4)
            expect[s // bs, h, s % bs, :used] = units[:, :unit].reshape(-1).cuda()
    assert torch.equal(alloc, expect)


@pytest.mark.gpu
def test_gpu_tq_pattern_probe_runs(tmp_path, capsys):
    path = str(tmp_path / "rows.json")
    assert tool(["probes", "tq-pattern", "--implementation", "cuda", "--presets",
                 "turboquant_k8v4,turboquant_4bit_nc", "--num-tokens", "16,1024", "--kinds",
                 "turboquant,pattern,pattern_nhd,pattern_1,pattern_row,pattern_row_nhd", "--iters",
                 "5", "--json", path]) == 0
    with open(path) as f:
        rows = json.load(f)["rows"]
    kinds = sorted({r["kind"] for r in rows if r.get("median_us")})
    assert kinds == ["pattern", "pattern_1", "pattern_nhd", "pattern_row", "pattern_row_nhd",
                     "turboquant"], rows[:2]


@pytest.mark.gpu
def test_gpu_chain_probe_runs(capsys):
    from kvwrite.kernels import nvrtc

    assert tool(["probes", "chain", "--sets", "4", "--replays", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    launches = {"plain", "pdl"} if nvrtc.pdl_capable(torch.cuda.current_device()) else {"plain"}
    assert lines[0].startswith("# ") and len(lines) == 1 + 8 * len(launches)
    us = {tuple(ln[:56].split(maxsplit=2)): float(ln.split()[-1]) for ln in lines[1:]}
    assert {k[1] for k in us} == launches and {k[0] for k in us} == {"hot", "cold"}
    assert len(us) == len(lines) - 1 and all(v > 0 for v in us.values())


@pytest.mark.gpu
def test_gpu_pdl_step_probe_runs(capsys):
    from kvwrite.kernels import nvrtc

    assert tool(["probes", "pdl-step", "--tokens", "1,16", "--replays", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# ") and len(lines) == 5
    assert all(ln.startswith("T=") and ln.count("->") == 2 for ln in lines[1:]), lines
    assert nvrtc.pdl_on()  # left as it was


@needs_nvrtc
def test_the_pdl_builds_of_the_floor_kernels_wait_before_any_memory_access(tmp_path):
    """probe chain's PDL builds: PREEXIT and ACQBULK before the first global access (a read-only
    load hoisted above the wait would start before the call before it has finished)."""
    import sass as sass_tools

    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton wheel) to read the SASS")
    names = ["kvw_empty", "kvw_slot_store", "kvw_rope_chain", "kvw_rope_row_chain",
             "kvw_tq_pattern<1>", "kvw_tq_pattern<4>", "kvw_tq_row_pattern"]
    obj, _ = common.SOURCE.compile("sm_90", names, macros=(common.nvrtc.PDL_MACRO,))
    funcs = sass_tools.functions(sass_tools.dump_sass(bytes(obj.code), tmp_path))
    assert set(funcs) == {obj.symbol_mapping[n].decode() for n in names}
    for name, ops in funcs.items():
        wait = ops.index("ACQBULK")
        assert "PREEXIT" in ops[:wait], name
        assert not [o for o in ops[:wait] if o.startswith(("LDG", "STG", "LD.", "ST."))], (name, ops)


# ------------------------------------------------------------------------------------------
# triton-code: a Triton kernel's sm_90 code, compiled without a GPU
# ------------------------------------------------------------------------------------------
_PTH_ARGS = ["kvwrite.ops.reshape_and_cache_flash_per_token_head_quant.triton_impl:_pth_kernel",
             *(f"--arg={n}=*bf16" for n in ("key_ptr", "value_ptr")),
             *(f"--arg={n}=*u8" for n in ("kc_ptr", "vc_ptr")),
             *(f"--arg={n}=*fp32" for n in ("ks_ptr", "vs_ptr")), "--arg=slot_mapping_ptr=*i64",
             *(f"--const={n}={v}" for n, v in (
                 ("BLOCK_SIZE", 16), ("DK", 128), ("DV", 128), ("BLOCK_DK", 128),
                 ("BLOCK_DV", 128), ("BLOCK_T", 2), ("BLOCK_H", 8), ("MODE", 2), ("ALIGN", 16),
                 ("COMPILED", True), ("NATIVE", True), ("PDL", False), ("PDL_TRIGGER", False)))]


def _triton_code(argv: list[str], tmp_path, path: tuple[str, ...] = ()):
    """``python -m tools.probes triton-code ARGV --json`` outside Triton's interpreter, with
    ``path`` first on PYTHONPATH: (exit status, stderr, the JSON or None)."""
    pytest.importorskip("triton")
    out = tmp_path / "code.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([*path, SRC] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    res = subprocess.run([sys.executable, "-m", "tools.probes", "triton-code", *argv,
                          f"--json={out}"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    return res.returncode, res.stderr, json.loads(out.read_text()) if out.exists() else None


def test_triton_code_counts_a_kernels_sm90_instructions(tmp_path):
    """The per-token-head kernel's int4 build with and without its fast path: the directed sums
    (FADD.RM) only with it; registers read from the cubin; totals by opcode and by pipe agree."""
    rc, err, fast = _triton_code([*_PTH_ARGS, "--const=FAST=True"], tmp_path)
    assert rc == 0, err[-2000:]
    rc, err, general = _triton_code([*_PTH_ARGS, "--const=FAST=False"], tmp_path)
    assert rc == 0, err[-2000:]
    assert fast["opcodes"].get("FADD.RM", 0) > 0 and "FADD.RM" not in general["opcodes"]
    for r in (fast, general):
        assert r["instructions"] == sum(r["opcodes"].values()) == sum(r["pipes"].values())
        assert r["registers"] > 0 and r["pipes"]["fma"] > 0 and r["pipes"]["alu"] > 0


def test_triton_code_names_what_is_missing(tmp_path):
    """A constexpr left out is one line naming it, exit status 2, no JSON."""
    rc, err, got = _triton_code(_PTH_ARGS, tmp_path)
    assert rc == 2 and got is None
    assert err.strip().count("\n") == 0 and "FAST" in err and "--const" in err, err


def test_triton_code_counts_past_address_ffff():
    """Instructions at five-digit addresses count (the listing's 4097th instruction on)."""
    from tools.probes.triton_code import opcodes
    sass = ("        /*0000*/                   LDC R1, c[0x0][0x28] ;\n"
            "        /*fff0*/              @!P0 FADD R2, R3, R4 ;\n"
            "        /*10000*/                  FADD R5, R6, R7 ;\n"
            "        /*1a2b0*/             @UP1 EXIT ;\n")
    assert opcodes(sass) == {"LDC": 1, "FADD": 2, "EXIT": 1}


def test_triton_code_names_a_nested_compile_error(tmp_path):
    """A kernel whose helper does not compile: one line naming where (the call's line in the
    kernel) and what (the innermost error), exit status 2."""
    (tmp_path / "bad_kernel.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef helper(x):\n"
        "    for i in tl.static_range(2):\n        C: tl.constexpr = i\n    return x\n\n\n"
        "@triton.jit\ndef kernel(p):\n    tl.store(p, helper(tl.load(p)))\n")
    rc, err, got = _triton_code(["bad_kernel:kernel", "--arg=p=*fp32"], tmp_path,
                                (str(tmp_path),))
    assert rc == 2 and got is None and err.strip().count("\n") == 0, err
    assert "did not compile: at 2:16: " in err and "reassigned" in err, err
