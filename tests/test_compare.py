"""`kvwrite-bench compare OLD NEW` (CPU): points matched by their fields, never by position;
unmatched and skipped rows counted and listed; geometric means per group; the worst points; the
threshold's exit status; bad input is one line on stderr and exit status 2. The files are written
by report.py's own writer. No timing is measured here."""

import json
import re
from pathlib import Path

import pytest

from kvwrite.bench.cli import main
from kvwrite.bench.report import Row, write_json

ROOT = Path(__file__).resolve().parents[1]


def _row(t: int, us: float, impl: str = "cuda", layout: str = "NHD", **kw) -> Row:
    params = {"layout": layout, "dtype": "bfloat16", "kv_cache_dtype": kw.pop("kv", "auto"),
              "num_heads": kw.pop("heads", 8), "head_size": 128}
    return Row(op=kw.pop("op", "reshape_and_cache_flash"), kind=kw.pop("kind",
               "reshape_and_cache_flash"), implementation=impl, num_tokens=t, params=params,
               latency_us=us, median_us=us, p20_us=us, p80_us=us, mean_us=us,
               device=kw.pop("device", "NVIDIA H200"), torch_version="2.13.0", **kw)


def _write(path: Path, rows: list[Row]) -> str:
    write_json(str(path), rows, {"op": rows[0].op, "command": "kvwrite-bench test"})
    return str(path)


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["compare", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _compare_json(capsys, tmp_path, old, new, *flags) -> tuple[int, dict, str]:
    js = tmp_path / "cmp.json"
    rc, out, err = _run(capsys, old, new, "--json", js, *flags)
    assert err == ""
    return rc, json.loads(js.read_text()), out


def test_points_are_matched_by_their_fields_not_their_position(capsys, tmp_path):
    old = [_row(t, us, impl, layout) for impl in ("cuda", "triton") for layout in ("NHD", "HND")
           for t, us in ((2, 1.0), (1024, 10.0))]
    # NEW: the same points reversed and split over two files of a folder, each 1.5x (HND) or 2x
    # (NHD) slower; a hot-L2 row and an fp8 row of the same T/layout are other points.
    new = [_row(r.num_tokens, r.median_us * (2 if r.layout == "NHD" else 1.5), r.implementation,
                r.layout) for r in reversed(old)]
    new += [_row(2, 5.0, "cuda", "NHD", l2="hot"), _row(2, 5.0, "cuda", "NHD", kv="fp8")]
    (tmp_path / "new").mkdir()
    _write(tmp_path / "new" / "a.json", new[:3])
    _write(tmp_path / "new" / "b.json", new[3:])
    rc, doc, out = _compare_json(capsys, tmp_path, _write(tmp_path / "old.json", old),
                                 tmp_path / "new")
    assert rc == 0
    got = {(p["implementation"], p["layout"], p["num_tokens"], p["l2"], p["kv_cache_dtype"]):
           (p["old_us"], p["new_us"], p["ratio"]) for p in doc["points"]}
    assert got == {(r.implementation, r.layout, r.num_tokens, "rotated", "auto"):
                   (r.median_us, r.median_us * (2 if r.layout == "NHD" else 1.5),
                    2 if r.layout == "NHD" else 1.5) for r in old}
    assert len(doc["only_in_new"]) == 2 and not doc["only_in_old"]
    assert {(d["l2"], d["kv_cache_dtype"]) for d in doc["only_in_new"]} == {("hot", "auto"),
                                                                            ("rotated", "fp8")}
    assert re.search(r"^cuda +NHD +2 +1\.000 +2\.000 +2\.000$",
                     re.sub(r"^reshape_and_cache_flash +|implementation=|layout=", "", out,
                            flags=re.M), re.M)


def test_unmatched_and_skipped_rows_are_counted_and_named(capsys, tmp_path):
    old = [_row(t, 1.0) for t in (2, 32, 1024)] + [_row(2, 1.0, status="error: boom")]
    new = [_row(t, 1.0) for t in (2, 64)]
    new += [_row(1024, float("nan"), status="mismatch: 3 bytes differ", check="failed")]
    old_f, new_f = _write(tmp_path / "old.json", old), _write(tmp_path / "new.json", new)
    rc, out, err = _run(capsys, old_f, new_f)
    assert rc == 0 and err == ""
    assert "only in OLD: 2 points" in out and "only in NEW: 1 points" in out
    assert re.search(rf"^  {re.escape(old_f)}: .* T=32,1024$", out, re.M)
    assert re.search(rf"^  {re.escape(new_f)}: .* T=64$", out, re.M)
    assert "skipped in OLD (status not ok): 1 rows: 1 x error: boom" in out
    assert "skipped in NEW (status not ok): 1 rows: 1 x mismatch: 3 bytes differ" in out
    assert "matched 1 points in 1 groups; only in OLD 2, only in NEW 1; skipped OLD 1, NEW 1" in out


def test_geometric_mean_per_op_and_configuration(capsys, tmp_path):
    old = [_row(t, 1.0, impl) for impl in ("cuda", "triton") for t in (2, 1024)]
    old += [_row(2, 1.0, op="gather", kind="cp"), _row(16, 1.0, op="gather", kind="cp")]
    ratio = {("cuda", 2): 2.0, ("cuda", 1024): 0.5, ("triton", 2): 1.21, ("triton", 1024): 1.0}
    new = [_row(r.num_tokens, 1.1 if r.op == "gather" else ratio[r.implementation, r.num_tokens],
                r.implementation, op=r.op, kind=r.kind) for r in old]
    rc, doc, out = _compare_json(capsys, tmp_path, _write(tmp_path / "old.json", old),
                                 _write(tmp_path / "new.json", new))
    groups = {(g["op"], g["config"]): (g["points"], round(g["geomean"], 9)) for g in doc["groups"]}
    assert groups == {("reshape_and_cache_flash", "implementation=cuda"): (2, 1.0),
                      ("reshape_and_cache_flash", "implementation=triton"): (2, 1.1),
                      ("gather", ""): (2, 1.1)}
    assert re.search(r"^reshape_and_cache_flash +implementation=triton +2 +1\.100 +1\.000 +"
                     r"1\.210$", out, re.M)


def test_a_field_sized_for_num_tokens_stays_in_one_group(capsys, tmp_path):
    # rope's num_blocks follows T (a cache sized for the call): one group over T, not one per T.
    old = [_row(t, 1.0, op="rope", kind="fused") for t in (16, 1024)]
    for r in old:
        r.params["num_blocks"] = r.num_tokens // 16 + 1
    rc, doc, _ = _compare_json(capsys, tmp_path, _write(tmp_path / "old.json", old),
                               _write(tmp_path / "new.json", old))
    assert [(g["points"], g["geomean"]) for g in doc["groups"]] == [(2, 1.0)]


def test_worst_points_are_the_largest_ratios(capsys, tmp_path):
    old = [_row(t, 1.0) for t in (1, 2, 4, 8)]
    new = [_row(t, us) for t, us in ((1, 1.1), (2, 3.0), (4, 0.5), (8, 1.7))]
    rc, out, _ = _run(capsys, _write(tmp_path / "old.json", old),
                      _write(tmp_path / "new.json", new), "--worst", 2)
    worst = out.split("the 2 worst points:\n")[1].split("\n\n")[0].splitlines()[2:]
    assert [line.split()[-1] for line in worst] == ["3.000", "1.700"]
    assert [int(line.split()[-4]) for line in worst] == [2, 8]
    rc, out, _ = _run(capsys, tmp_path / "old.json", tmp_path / "new.json", "--worst", 0)
    assert "worst points:" not in out


@pytest.mark.parametrize("threshold, rc, flagged", [(None, 0, 0), (5, 0, 0), (3, 1, 1),
                                                     (0, 1, 1)])
def test_threshold_flags_points_and_groups_and_sets_the_exit_status(capsys, tmp_path, threshold,
                                                                    rc, flagged):
    old = [_row(2, 1.0), _row(1024, 100.0)]
    new = [_row(2, 1.04), _row(1024, 100.0)]  # +4% at T=2; the group's geometric mean +2%
    flags = [] if threshold is None else ["--threshold", threshold]
    got, doc, out = _compare_json(capsys, tmp_path, _write(tmp_path / "old.json", old),
                                  _write(tmp_path / "new.json", new), *flags)
    assert got == rc
    assert sum(p["flagged"] for p in doc["points"]) == flagged
    assert doc["groups"][0]["flagged"] == (threshold == 0)
    assert out.count("SLOWER") == flagged + (threshold == 0)
    if threshold is not None:
        assert f"threshold {threshold}%: {flagged} points and {int(threshold == 0)} groups" in out
        assert ("REGRESSION" in out) == bool(rc)


def test_numbers_are_fixed_point(capsys, tmp_path):
    old = [_row(2, 0.00012), _row(4, 1234567.0)]
    new = [_row(2, 0.00024), _row(4, 123.0)]
    rc, out, _ = _run(capsys, _write(tmp_path / "old.json", old),
                      _write(tmp_path / "new.json", new))
    assert "1234567.000" in out and "0.000100" not in out and "2.000" in out
    assert not re.search(r"\de[+-]?\d", out)


def _bad_cases(tmp_path: Path) -> dict:
    good = _write(tmp_path / "good.json", [_row(2, 1.0)])
    (tmp_path / "empty").mkdir()
    (tmp_path / "text.json").write_text("not json")
    twice = tmp_path / "twice"
    twice.mkdir()
    _write(twice / "a.json", [_row(2, 1.0)])
    _write(twice / "b.json", [_row(2, 1.5)])
    other = _write(tmp_path / "other.json", [_row(2, 1.0, layout="HND")])
    h100 = _write(tmp_path / "h100.json", [_row(2, 1.0, device="NVIDIA H100 80GB HBM3")])
    return {
        "missing file": ([tmp_path / "absent.json", good], "absent.json: cannot read it"),
        "not json": ([good, tmp_path / "text.json"], "does not parse as JSON"),
        "empty folder": ([tmp_path / "empty", good], "expected --json files in the folder"),
        "glob without match": ([tmp_path / "nothing*.json", good], "to match --json files"),
        "a point twice": ([good, twice], "expected each point once"),
        "no point on both sides": ([good, other], "layout: OLD NHD, NEW HND"),
        "different GPUs": ([good, h100], "OLD NVIDIA H200 vs NEW NVIDIA H100 80GB HBM3; pass "
                                         "--any-gpu"),
        "negative threshold": ([good, good, "--threshold", "-1"], "--threshold: expected a "
                                                                  "percentage >= 0"),
        "threshold not a number": ([good, good, "--threshold", "5%"], "got '5%'"),
        "bad worst": ([good, good, "--worst", "x"], "--worst: expected a whole number"),
        "json path is a folder": ([good, good, "--json", tmp_path], "--json: expected a file "
                                                                    "path"),
        "one file only": ([good], "the following arguments are required: NEW"),
    }


@pytest.mark.parametrize("case", [
    "missing file", "not json", "empty folder", "glob without match", "a point twice",
    "no point on both sides", "different GPUs", "negative threshold", "threshold not a number",
    "bad worst", "json path is a folder", "one file only"])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, case):
    argv, message = _bad_cases(tmp_path)[case]
    with pytest.raises(SystemExit) as e:
        main(["compare", *map(str, argv)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.startswith("kvwrite-bench compare: error: ") and err.count("\n") == 1, err
    assert message in err


def test_any_gpu_compares_rows_of_different_gpus(capsys, tmp_path):
    rc, out, err = _run(capsys, _write(tmp_path / "a.json", [_row(2, 1.0)]),
                        _write(tmp_path / "b.json", [_row(2, 1.0, device="NVIDIA H100")]),
                        "--any-gpu")
    assert rc == 0 and "NVIDIA H100" in out


def test_the_committed_run_against_itself_is_all_ones(capsys, tmp_path):
    data = ROOT / "docs" / "data"
    rc, doc, out = _compare_json(capsys, tmp_path, data, f"{data}/*.json", "--threshold", "0",
                                 "--csv", tmp_path / "cmp.csv")
    assert rc == 0
    # Rows without a measurement (a series that cannot run a point says why instead) are
    # skipped on both sides and counted; every measured row is a point.
    all_rows = [r for p in data.glob("*.json") for r in json.loads(p.read_text())["rows"]]
    rows = sum(1 for r in all_rows if r["status"] == "ok" and r["median_us"] == r["median_us"]
               and r["median_us"] > 0)
    assert len(doc["points"]) == rows and not doc["only_in_old"] and not doc["only_in_new"]
    assert {p["ratio"] for p in doc["points"]} == {1.0}
    assert {g["geomean"] for g in doc["groups"]} == {1.0}
    table = out.split("per point:\n")[1].split("\n\n")[0].splitlines()[2:]
    assert len(table) == rows and {line.split()[-1] for line in table} == {"1.000"}
    assert (tmp_path / "cmp.csv").read_text().count("\n") == rows + 1


def test_measured_params_are_not_part_of_a_points_identity(capsys, tmp_path):
    """Transfer rows carry the run's limit, NCCL figure and host time as params: two runs' rows of the same
    point differ there and must still match."""
    def rows(limit, host):
        out = [_row(t, us, op="swap_blocks", kind="swap_blocks") for t, us in ((16, 10.0),
                                                                               (128, 80.0))]
        for r in out:
            r.params.update(limit_gbps=limit, nccl_gbps=0.9 * limit, host_us=host)
        return out

    rc, doc, _ = _compare_json(capsys, tmp_path, _write(tmp_path / "old.json", rows(1993.4, 931.6)),
                               _write(tmp_path / "new.json", rows(2115.3, 1003.9)))
    assert rc == 0 and len(doc["points"]) == 2 and not doc["only_in_new"]
    assert {p["ratio"] for p in doc["points"]} == {1.0}
