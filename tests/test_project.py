"""The README's set-up commands and CI stay in step."""

from pathlib import Path

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
