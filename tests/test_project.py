"""The README's set-up commands and CI stay in step."""

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    return [ln.strip() for ln in lines[:30] if ln.strip().startswith("python3 -m venv")]


def test_readme_opens_with_the_two_setup_commands():
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    bench, tests = cmds
    assert "kvwrite-bench" in bench
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command():
    test_cmd = _readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in [ln.strip() for ln in ci]


def test_kernel_source_ships_as_package_data():
    pyproject = (ROOT / "pyproject.toml").read_text()
    line = next(ln for ln in pyproject.splitlines() if ln.startswith("kvwrite = ["))
    globs = [g.strip().strip('"') for g in line.split("[", 1)[1].rstrip("]").split(",")]
    pkg = ROOT / "src" / "kvwrite"
    sources = [p for ext in ("*.cu", "*.cuh") for p in pkg.rglob(ext)]
    assert sources
    for src in sources:  # every kernel source and header matches a package-data glob
        assert any(src.relative_to(pkg).match(g) for g in globs), (src, globs)


def test_the_two_commands_install_the_same_torch():
    # One .venv, one torch pin: the commands differ only in the extras they install.
    pins = [re.search(r"pip install -q (.*?) -e", cmd) for cmd in _readme_commands()]
    assert all(pins), _readme_commands()
    assert pins[0].group(1) == pins[1].group(1) and "torch==" in pins[0].group(1)


def _dependencies(extra: str | None = None) -> list[str]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] if extra is None else project["optional-dependencies"][extra]


def _installed_names(env: dict, extra: str) -> set[str]:
    """The distributions pip would pick for ``kvwrite[extra]`` on the platform ``env`` describes."""
    requirements = pytest.importorskip("packaging.requirements")
    names = set()
    for spec in [*_dependencies(), *_dependencies(extra)]:
        req = requirements.Requirement(spec)
        if req.marker is None or req.marker.evaluate({**env, "extra": extra}):
            names.add(req.name)
    return names


def _platform(system: str, machine: str) -> dict:
    sys_platform = {"Linux": "linux", "Darwin": "darwin", "Windows": "win32"}[system]
    return {"platform_system": system, "platform_machine": machine, "sys_platform": sys_platform,
            "python_version": "3.11", "python_full_version": "3.11.9", "os_name":
            "nt" if system == "Windows" else "posix", "implementation_name": "cpython",
            "platform_python_implementation": "CPython"}


GPU_PACKAGES = {"triton", "cuda-core", "cuda-bindings", "nvidia-cuda-nvrtc"}


def test_gpu_packages_install_only_where_their_wheels_exist():
    # macOS has torch wheels but none of these: the reference and the tests install there.
    for machine in ("arm64", "x86_64"):
        names = _installed_names(_platform("Darwin", machine), "test")
        assert not names & GPU_PACKAGES, names
        assert {"torch", "numpy", "pytest", "tabulate"} <= names
    # CI (Linux x86-64) compiles the kernels with NVRTC and runs Triton's interpreter.
    for machine in ("x86_64", "aarch64"):
        assert _installed_names(_platform("Linux", machine), "test") >= GPU_PACKAGES
    # The benchmark's CPU install leaves triton (1 GB) to CUDA builds of torch, which bring it.
    bench = _installed_names(_platform("Linux", "x86_64"), "plot")
    assert "triton" not in bench and GPU_PACKAGES - {"triton"} <= bench
    windows = _installed_names(_platform("Windows", "AMD64"), "plot")
    assert {"cuda-core", "cuda-bindings", "nvidia-cuda-nvrtc"} <= windows
    assert "triton" not in windows


def test_the_test_extra_has_what_the_tests_import():
    names = {re.split(r"[<>=;\[ ]", spec, maxsplit=1)[0] for spec in _dependencies("test")}
    assert {"pytest", "pytest-xdist", "tabulate", "matplotlib"} <= names


def test_the_test_command_runs_on_every_cpu():
    # pytest-xdist's -n auto: tests/conftest.py's pytest_xdist_auto_num_workers picks the count.
    assert _readme_commands()[1].endswith("python -m pytest -q -n auto")


def test_gpu_tests_are_deselected_with_one_line_where_there_is_no_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the gpu tests are selected and run here")
    test = "tests/test_bench.py::test_parse_num_tokens tests/test_bench.py::test_gpu_run_benchmark"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *test.split()]
    plain = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "1 passed, 1 deselected" in plain.stdout
    lines = [ln for ln in plain.stdout.splitlines() if "gpu tests deselected" in ln]
    assert lines == ["1 gpu tests deselected: no CUDA GPU here (torch.cuda.is_available() is "
                     "False); on a GPU machine `python -m pytest -m gpu` runs them"]
    assert "SKIPPED" not in plain.stdout
    # -m gpu selects them; here they skip, each with the reason.
    marked = subprocess.run(run + ["-m", "gpu"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert "1 skipped, 1 deselected" in marked.stdout, marked.stdout
    assert "needs a CUDA GPU" in marked.stdout


_SUMMARY_TESTS = """
import pytest

@pytest.mark.parametrize("i", range(2))
def test_skip_a(i):
    pytest.skip("reason a")

def test_skip_b():
    pytest.skip("reason b")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "the failure, in full"

@pytest.mark.gpu
def test_on_a_gpu():
    pass
"""


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["plain", "xdist"])
def test_skips_are_counted_by_reason_and_failures_shown_in_full(tmp_path, workers):
    """The suite's conftest and addopts, on a few tests: skips as counts by reason (no SKIPPED
    line each), a failure in full, the gpu line; also under pytest-xdist."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: no gpu test is deselected")
    tomllib = pytest.importorskip("tomllib")
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = " + options["addopts"] + "\nmarkers =\n    "
        + "\n    ".join(options["markers"]) + "\n")
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_summary.py").write_text(_SUMMARY_TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *workers], cwd=tmp_path, env=env, capture_output=True, text=True)
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    assert "SKIPPED" not in out
    assert "3 skipped, by reason" in out
    lines = out.splitlines()
    assert "    2  reason a" in lines and "    1  reason b" in lines
    assert "FAILED test_summary.py::test_fails" in out and "the failure, in full" in out
    assert ("1 gpu tests deselected: no CUDA GPU here (torch.cuda.is_available() is False); on a "
            "GPU machine `python -m pytest -m gpu` runs them") in lines
    assert "1 failed, 1 passed, 3 skipped" in out


def _run_readme_example(device: str) -> dict:
    """The README's Python example run on ``device`` (its "cuda" replaced), its names returned,
    after the checks of what it wrote: every cache written only at the valid slots (-1 padding
    skipped, no two tokens in one slot), and the per-token-head rows read back ≈ the keys."""
    import kvwrite

    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start:text.index("```\n", start)]
    assert "concat_and_cache_mla" in code and "fused_rope_and_reshape_cache_flash" in code
    names: dict = {}
    exec(compile(code.replace('"cuda"', f'"{device}"'), "README.md", "exec"), names)

    slots = names["slot_mapping"].cpu()
    valid = slots[slots >= 0]
    assert valid.unique().numel() == valid.numel() == 4, slots  # the padding, no collisions
    tokens = torch.nonzero(slots >= 0).flatten()

    def untouched_outside(t, fresh, name):
        # Rows [num_blocks, block_size, ...] -> [slots, ...]: no byte moved outside the valid slots.
        assert t.shape[0] * t.shape[1] > valid.max(), (
            f"{name}: {t.shape[0] * t.shape[1]} slots, but the example's slots go to "
            f"{valid.max()}: every op takes slot_mapping as it is (no clamping into collisions)")
        got = t.detach().cpu().reshape(-1, *t.shape[2:]).contiguous().view(torch.uint8)
        want = fresh.detach().cpu().reshape(-1, *fresh.shape[2:]).contiguous().view(torch.uint8)
        other = torch.ones(got.shape[0], dtype=torch.bool)
        other[valid] = False
        assert torch.equal(got[other], want[other]), f"{name}: written outside the valid slots"
        assert not torch.equal(got[valid], want[valid]), f"{name}: the valid slots not written"

    fresh = kvwrite.create_per_token_head_caches(*names["kc"].shape[:3], 128,
                                                 "int8_per_token_head", device=device)
    for name, fresh_t in zip(("kc", "vc", "ks", "vs"), fresh, strict=True):
        untouched_outside(names[name], fresh_t, name)
    untouched_outside(names["mla_cache"], torch.zeros_like(names["mla_cache"]), "mla_cache")
    fresh_k, fresh_v = kvwrite.create_kv_caches_with_random_flash(
        num_blocks=1024, block_size=16, num_layers=1, num_heads=8, head_size=128,
        cache_dtype="fp8", seed=0, device=device, cache_layout="NHD")  # the example's
    untouched_outside(names["key_caches"][0], fresh_k[0], "key_caches[0]")
    untouched_outside(names["value_caches"][0], fresh_v[0], "value_caches[0]")

    # int8 rows with one scale per (token, head): within half a step (amax / 127) of the key.
    key = names["key"].float().cpu()[tokens]
    step = key.abs().amax(-1, keepdim=True) / 127
    assert torch.all((names["rows"].cpu() - key).abs() <= step * 0.5001 + 1e-6)
    return names


def test_readme_example_runs_on_the_cpu():
    _run_readme_example("cpu")


@pytest.mark.gpu
def test_readme_example_runs_as_written_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    _run_readme_example("cuda")


def test_performance_page_is_the_report_of_the_committed_runs(tmp_path):
    """docs/performance.md's tables are `kvwrite-bench report` of docs/data/*.json, as committed
    (regenerate with `kvwrite-bench report --into docs/performance.md docs/data/*.json`)."""
    from kvwrite.bench.cli import main

    page = (ROOT / "docs" / "performance.md").read_text()
    data = sorted(str(p) for p in (ROOT / "docs" / "data").glob("*.json"))
    assert data, "docs/data holds the latest GPU run's JSON files"
    copy = tmp_path / "performance.md"
    copy.write_text(page)
    assert main(["report", "--into", str(copy), *data]) == 0
    assert copy.read_text() == page
    # The method and one compact section per op family (970 since the two-GPU transfer and NCCL
    # handoff tables, QK-norm's unit-scale run and NVFP4's T = 512, 2048 and 4096 rows).
    assert len(page.splitlines()) <= 970


# --- what Triton's interpreter (the CPU path for Triton) runs --------------------------------------

ROW_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLASH_MODES = ("auto", "float16", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2")


def _interpreter_calls():
    """(op, mode, case_args for a row dtype) for every op and mode: each op's ``unsupported``
    arguments, with tensors that carry only the device and dtypes it reads (rows of the given
    dtype: the inputs of a write, the output of a read)."""
    from kvwrite import formats
    from kvwrite.dtypes import parse_kv_cache_dtype
    from kvwrite.formats import TURBOQUANT_PRESETS
    from kvwrite.ops.concat_and_cache_mla import MlaMode
    from kvwrite.ops.indexer_k_quant_and_cache.op import ScaleFormat
    from kvwrite.ops.nvfp4.op import ScaleLayout
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import PerTokenHeadMode

    def t(dtype):
        return torch.empty(1, dtype=dtype)

    def cache(mode, dtype):
        c = parse_kv_cache_dtype(mode)
        return t(torch.uint8 if c.is_fp8 else c.element_dtype(dtype))

    u8, f32 = torch.uint8, torch.float32
    calls = []
    for mode in FLASH_MODES:
        c = parse_kv_cache_dtype(mode)
        calls.append(("reshape_and_cache_flash", mode,
                      lambda d, c=c, m=mode: (t(d), cache(m, d), c, t(f32), t(f32))))
        calls.append(("reshape_and_cache", mode, lambda d, c=c, m=mode: (t(d), cache(m, d), c, t(f32))))
        calls.append(("fused_rope_and_reshape_cache_flash", mode,
                      lambda d, c=c, m=mode: (t(d), t(d), cache(m, d), c, t(d), True)))
        calls.append(("fused_qk_norm_rope_and_reshape_cache_flash", mode,
                      lambda d, c=c, m=mode: (t(d), t(d), t(d), t(d), True, cache(m, d), c, None)))
    for mode in ("nvfp4", "nvfp4_4over6"):
        c = parse_kv_cache_dtype(mode, nvfp4=True)
        calls.append(("nvfp4_kv_write", mode, lambda d, c=c: (t(d), t(u8), c, ScaleLayout.LINEAR)))
    for mode in ("mxfp8", "mxfp4"):
        fmt = formats.lookup(mode)
        for layout in ("linear", "interleaved128"):
            calls.append(("mx_kv_write", f"{mode} {layout}",
                          lambda d, f=fmt, lay=layout: (t(d), t(u8), f, lay)))
    calls.append(("rotary_embedding", "", lambda d: (t(d), t(d), t(d), True)))
    calls.append(("fused_qk_norm_rope", "", lambda d: (t(d), t(d), t(d), t(d), True)))
    for mode in MlaMode:
        calls.append(("concat_and_cache_mla", mode.value,
                      lambda d, m=mode: (t(d), t(d if m is MlaMode.AUTO else u8), m)))
    for mode in PerTokenHeadMode:
        calls.append(("reshape_and_cache_flash_per_token_head_quant", mode.value,
                      lambda d, m=mode: (t(d), t(d), t(u8), t(u8), m)))
    for fmt in ScaleFormat:
        calls.append(("indexer_k_quant_and_cache", fmt.value, lambda d, f=fmt: (t(d), t(u8), f)))
    for preset in TURBOQUANT_PRESETS:
        calls.append(("reshape_and_cache_turboquant", preset.name,
                      lambda d, p=preset: (torch.empty(1, 1, 128, dtype=d), t(u8), p.at(128))))
    for mode in (MlaMode.AUTO, MlaMode.FP8_E4M3, MlaMode.FP8_E5M2):
        calls.append(("gather_and_maybe_dequant_cache", mode.value,
                      lambda d, m=mode: (t(d if m is MlaMode.AUTO else u8), t(d), m)))
    for mode in ("auto", "fp8_e4m3", "fp8_e5m2"):
        c = parse_kv_cache_dtype(mode)
        calls.append(("gather_cache_flash", mode, lambda d, c=c, m=mode: (cache(m, d), t(d), c)))
    calls.append(("cp_gather_cache", "", lambda d: (t(d), t(d))))
    calls.append(("cp_gather_and_upconvert_fp8_kv_cache", "",
                  lambda d: (t(u8), t(torch.bfloat16))))  # its output is always bfloat16
    calls.append(("cp_gather_indexer_k_quant_cache", "", lambda d: (t(u8), t(u8), t(f32))))
    # The transfer ops take a plan; the interpreter runs their kernels on plans with a device
    # side (tests/test_transfer_triton.py): what they refuse depends on the sides, not the rows.
    def plan(d):
        return (types.SimpleNamespace(device=torch.device("cuda"), jobs=(), page_job=None),)
    for op in ("swap_blocks", "swap_blocks_multi_layer", "relayout_kv_cache"):
        calls.append((op, "", plan))
    for op in ("pack_kv_pages", "unpack_kv_pages"):
        for fmt in ("raw", "fp8_e4m3", "fp8_e5m2", "nvfp4"):
            calls.append((op, fmt, plan))
    return calls


def interpreter_coverage() -> str:
    """docs/testing.md's table of the calls Triton's interpreter refuses (its ``unsupported``), by
    op, mode and row dtype, and the counts."""
    from kvwrite import registry

    calls = _interpreter_calls()
    assert {op for op, _, _ in calls} == set(registry.ops())  # a new op needs its calls here
    names = [str(d).removeprefix("torch.") for d in ROW_DTYPES]
    modes: dict = {}  # op -> its modes, in order
    refused: dict = {}  # (op, dtype name) -> refused modes
    for op, mode, args in calls:
        modes.setdefault(op, []).append(mode)
        for d, name in zip(ROW_DTYPES, names, strict=True):
            if registry.get(op, "triton").unsupported(*args(d)) is not None:
                refused.setdefault((op, name), []).append(mode)

    def cell(op, name):
        got = refused.get((op, name), [])
        if not got:
            return "none"
        return "all" if got == modes[op] else ", ".join(got)

    rows: dict = {}  # ops with the same modes and cells share a row
    for op in modes:
        rows.setdefault((tuple(modes[op]), *(cell(op, n) for n in names)), []).append(op)
    total = len(calls)
    counts = [sum(len(refused.get((op, n), [])) for op in modes) for n in names]
    lines = ["| op (modes) | " + " | ".join(f"{n} rows" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for (op_modes, *cells), ops in rows.items():
        label = ", ".join(f"`{op}`" for op in ops)
        if op_modes != ("",):
            label += f" ({', '.join(op_modes)})"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| refused, of " + f"{total} calls | "
                 + " | ".join(str(c) for c in counts) + " |")
    return "\n".join(lines)


def test_testing_md_counts_what_the_triton_interpreter_refuses():
    if torch.cuda.is_available():
        pytest.skip("the interpreter's refusals are those of a machine without a GPU")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter is not on (conftest turns it on without a GPU)")
    block = interpreter_coverage()
    page = (ROOT / "docs" / "testing.md").read_text()
    assert block in page, "docs/testing.md must hold, verbatim:\n" + block
    total = block.splitlines()[-1].split("|")[1].split()[-2]
    bf16 = block.splitlines()[-1].split("|")[3].strip()
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"on bfloat16 rows it refuses {bf16} of {total} op × mode calls" in readme


# --- layers (issue 43): one direction of imports -------------------------------------------------

def test_ci_checks_the_import_layers():
    # The layers are import-linter's contract in pyproject.toml ([tool.importlinter]); CI runs
    # `lint-imports` after ruff, with import-linter from the test extra.
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ".venv/bin/lint-imports" in ci
    assert "import-linter" in {re.split(r"[<>=;\[ ]", spec, maxsplit=1)[0]
                               for spec in _dependencies("test")}


def test_no_import_cycle():
    """No module of kvwrite imports, directly or through others, a module that imports it (a
    deferred import inside a function counts too)."""
    grimp = pytest.importorskip("grimp")  # import-linter's graph builder (the test extra)
    graph = grimp.build_graph("kvwrite")
    cycles = sorted((m, d) for m in graph.modules for d in graph.find_modules_directly_imported_by(m)
                    if graph.find_shortest_chain(importer=d, imported=m))
    assert cycles == []


def _other_op_privates(path: Path) -> list[str]:
    """Names with a leading underscore that the module at ``path`` (under src/kvwrite/ops/<op>/)
    takes from another op's package: imported (``from ..b.x import _y``, ``from ..b import _x``,
    ``import kvwrite.ops.b._x``) or read off another op's module (``b._x``)."""
    import ast

    rel = path.relative_to(ROOT / "src").with_suffix("")
    parts = list(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    package = parts if rel.name == "__init__" else parts[:-1]
    own = parts[2]  # kvwrite.ops.<own>...

    def other_op(module: list[str]) -> str | None:
        if module[:2] == ["kvwrite", "ops"] and len(module) > 2 and module[2] != own:
            return module[2]
        return None

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    tree = ast.parse(path.read_text(), str(path))
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            for alias in node.names:
                target = module + [alias.name]
                op = other_op(module) or other_op(target)
                if op is None:
                    continue
                if any(private(p) for p in target[3:]):
                    found.append(f"{'.'.join(module)} import {alias.name}")
                else:
                    aliases[alias.asname or alias.name] = ".".join(target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module = alias.name.split(".")
                if other_op(module) and any(private(p) for p in module[3:]):
                    found.append(f"import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and private(node.attr)):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_no_op_imports_another_ops_private_name():
    # What two ops share moves down (core or kernels/); an op may use another op's public names
    # only (CONTRIBUTING.md, "Layers").
    ops = ROOT / "src" / "kvwrite" / "ops"
    found = {f"{p.relative_to(ops)}: {name}" for p in sorted(ops.rglob("*.py"))
             if p.parent != ops for name in _other_op_privates(p)}
    assert not found, "\n".join(sorted(found))


def test_testing_md_lists_every_test_file():
    """docs/testing.md has a row for each tests/test_*.py (what it checks, with and without a
    GPU), so a new file cannot go unexplained."""
    page = (ROOT / "docs" / "testing.md").read_text()
    missing = [p.name for p in sorted((ROOT / "tests").glob("test_*.py"))
               if f"`tests/{p.name}`" not in page]
    assert not missing, f"docs/testing.md lacks a row for {missing}"
