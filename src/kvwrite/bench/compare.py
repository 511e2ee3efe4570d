"""``kvwrite-bench compare OLD NEW``: two runs' ``--json`` files, point by point.

OLD and NEW are each a ``--json`` file, a folder (its ``*.json`` files) or a glob of them; every
row of a side goes into one pool (``kvwrite-bench compare docs/data OUT_DIR`` compares a new run
with the committed one, whatever files the rows were split into).

A point is matched by its identity: every field of a row that says *what* was measured — op,
kind, implementation, num_tokens, the timer, the mode, the L2 condition, the calls per sample,
and every param (layout, dtypes, shape, model, slots, variant, ...) — never by its position. The
rest (:data:`MEASURED`, and the params in ``report.MEASURED_PARAMS``) is the measurement and
where it ran. Rows whose status is not ``ok`` (or with no median) are skipped and counted;
identities found on one side only are listed.

Printed: a table of every matched point (old and new median µs per call, new/old), the geometric
mean of new/old per group (the points of one op and configuration: the identity less num_tokens
and the params that follow num_tokens, such as a cache sized for T), the ``--worst`` points, and
what is only on one side. ``--threshold PCT`` flags every point and group whose new/old exceeds
``1 + PCT/100``.

Exit status: 0; 1 when ``--threshold`` flags a point or a group; 2 for bad input (a file that
cannot be read or is not a ``--json`` file, no file at a path, a point twice on one side, no
point on both sides, rows of different GPUs without ``--any-gpu``, a bad flag): one line on
stderr, before anything is printed.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import json
import math
import os
import sys
from collections.abc import Sequence

from tabulate import tabulate

from .report import COMMON_FIELDS, MEASURED_PARAMS, ReportError, Row, read_json

__all__ = ["main", "compare", "Comparison", "CompareError", "MEASURED", "identity"]

# Row fields that are the measurement or its environment, not what was measured.
MEASURED = frozenset({
    "rotation_sets", "samples", "latency_us", "median_us", "p20_us", "p80_us", "mean_us",
    "bytes", "gbps", "pct_copy_bw", "copy_bw_gbps", "check", "status", "device",
    "torch_version", "triton_version", "cuda_version", "kvwrite_version"})
_ID_FIELDS = [f for f in COMMON_FIELDS if f not in MEASURED]
_VERSIONS = ("torch_version", "triton_version", "cuda_version", "kvwrite_version")


class CompareError(ValueError):
    """Bad input to compare; the message is the one line printed."""


def identity(row: Row) -> tuple:
    """The point ``row`` measured: ((field, value as JSON), ...) over every identifying field."""
    fields = {f: getattr(row, f) for f in _ID_FIELDS}
    fields.update((k, v) for k, v in row.params.items() if k not in MEASURED_PARAMS)
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in fields.items()))


@dataclasses.dataclass
class Side:
    """One side's rows, each with the file it came from."""

    spec: str
    files: list[str]
    rows: list[tuple[str, Row]]


@dataclasses.dataclass
class Point:
    key: tuple
    group: tuple
    old: Row
    new: Row

    @property
    def ratio(self) -> float:
        return self.new.median_us / self.old.median_us


@dataclasses.dataclass
class Group:
    key: tuple
    op: str
    label: str
    points: list[Point]

    @property
    def geomean(self) -> float:
        return math.exp(sum(math.log(p.ratio) for p in self.points) / len(self.points))


@dataclasses.dataclass
class Comparison:
    old: Side
    new: Side
    points: list[Point]            # in the order of the OLD rows
    groups: list[Group]
    labels: dict                   # point key -> its group's label
    only_old: list[tuple[str, Row]]
    only_new: list[tuple[str, Row]]
    skipped_old: list[tuple[str, Row]]
    skipped_new: list[tuple[str, Row]]
    threshold: float | None        # in %, or None

    def over(self, ratio: float) -> bool:
        return self.threshold is not None and ratio > 1 + self.threshold / 100

    @property
    def flagged_points(self) -> list[Point]:
        return [p for p in self.points if self.over(p.ratio)]

    @property
    def flagged_groups(self) -> list[Group]:
        return [g for g in self.groups if self.over(g.geomean)]


# --- reading -------------------------------------------------------------------------------------

def expand(what: str, spec: str) -> list[str]:
    """The files of ``spec``: itself, a folder's ``*.json`` (sorted) or a glob's matches."""
    if os.path.isdir(spec):
        files = sorted(glob.glob(os.path.join(glob.escape(spec), "*.json")))
        if not files:
            raise CompareError(f"{what}: expected --json files in the folder {spec!r}, got none")
        return files
    if os.path.exists(spec) or not glob.has_magic(spec):
        return [spec]
    files = sorted(glob.glob(spec))
    if not files:
        raise CompareError(f"{what}: expected the glob {spec!r} to match --json files, got none")
    return files


def read_side(what: str, spec: str) -> Side:
    files = expand(what, spec)
    rows = []
    for path in files:
        try:
            _, file_rows = read_json(path)
        except OSError as e:
            raise CompareError(f"{what}: {path}: cannot read it ({e.strerror or e})") from None
        except ReportError as e:
            text = str(e)
            raise CompareError(f"{what}: {text if text.startswith(path) else f'{path}: {text}'}"
                               ) from None
        rows += [(path, r) for r in file_rows]
    return Side(spec, files, rows)


def _usable(row: Row) -> bool:
    return row.ok and math.isfinite(row.median_us) and row.median_us > 0


def _pool(what: str, side: Side) -> tuple[dict, list]:
    """(identity -> (file, row)) of the usable rows, and the skipped (file, row)s."""
    pool: dict[tuple, tuple[str, Row]] = {}
    skipped = []
    for path, row in side.rows:
        if not _usable(row):
            skipped.append((path, row))
            continue
        key = identity(row)
        if key in pool:
            raise CompareError(f"{what}: expected each point once, got {_describe(row)} in both "
                               f"{pool[key][0]} and {path}")
        pool[key] = (path, row)
    return pool, skipped


def _describe(row: Row) -> str:
    params = " ".join(f"{k}={v}" for k, v in row.params.items() if v not in ("", None))
    return (f"{row.op} {row.kind} {row.implementation} T={row.num_tokens} {params} timer="
            f"{row.timer} mode={row.mode} l2={row.l2}")


def _mismatch_hint(old: dict, new: dict) -> str:
    """Why no identity is on both sides: the fields whose values differ between the sides."""
    def values(pool):
        out: dict[str, set] = {}
        for key in pool:
            for k, v in key:
                out.setdefault(k, set()).add(v)
        return out
    vo, vn = values(old), values(new)
    parts = [f"{k} only in OLD" for k in vo if k not in vn]
    parts += [f"{k} only in NEW" for k in vn if k not in vo]
    parts += [f"{k}: OLD {','.join(sorted(map(_plain, vo[k])))}, "
              f"NEW {','.join(sorted(map(_plain, vn[k])))}"
              for k in vo if k in vn and not vo[k] & vn[k]]
    return f" ({'; '.join(parts)})" if parts else ""


def _groups(points: list[Point]) -> tuple[list[Group], dict]:
    """Points grouped per op and configuration: the identity less num_tokens and the fields
    with one value per num_tokens within the op (a cache sized for T), labelled by the fields
    that vary over the op's groups."""
    by_op: dict[str, list[Point]] = {}
    for p in points:
        by_op.setdefault(p.old.op, []).append(p)
    groups, labels = [], {}
    for op, pts in by_op.items():
        values: dict[str, dict] = {}
        for p in pts:
            t = dict(p.key)["num_tokens"]
            for k, v in p.key:
                values.setdefault(k, {}).setdefault(t, set()).add(v)
        order = dict.fromkeys(k for p in pts for k in p.old.to_dict())  # the rows' own order
        varying = [k for k in order if k in values and k != "num_tokens"
                   and len(set().union(*values[k].values())) > 1]
        follows_t = {k for k in varying if all(len(v) == 1 for v in values[k].values())}
        split = [k for k in varying if k not in follows_t]
        by_key: dict[tuple, list[Point]] = {}
        for p in pts:
            d = dict(p.key)
            p.group = (op,) + tuple(d.get(k) for k in split)
            by_key.setdefault(p.group, []).append(p)
        for key, gpts in by_key.items():
            # A field some of the op's runs do not have (an MLA mode's own parameter) is left out.
            label = " ".join(f"{k}={_plain(v)}" for k, v in zip(split, key[1:], strict=True)
                             if v is not None)
            groups.append(Group(key, op, label, gpts))
            for p in gpts:
                labels[p.key] = label
    return groups, labels


def _plain(v: str) -> str:
    value = json.loads(v)
    return value if isinstance(value, str) else json.dumps(value)


def compare(old: Side, new: Side, threshold: float | None = None,
            any_gpu: bool = False) -> Comparison:
    """Match ``old`` and ``new`` point by point; raises CompareError on bad input."""
    old_pool, skipped_old = _pool("OLD", old)
    new_pool, skipped_new = _pool("NEW", new)
    shared = [k for k in old_pool if k in new_pool]
    if not shared:
        raise CompareError(f"expected points measured on both sides, got none: OLD has "
                           f"{len(old_pool)} usable rows, NEW {len(new_pool)}"
                           f"{_mismatch_hint(old_pool, new_pool)}")
    gpus = sorted({(old_pool[k][1].device, new_pool[k][1].device) for k in shared
                   if old_pool[k][1].device != new_pool[k][1].device})
    if gpus and not any_gpu:
        what = ", ".join(f"OLD {o or '?'} vs NEW {n or '?'}" for o, n in gpus)
        raise CompareError(f"expected rows measured on one GPU, got {what}; pass --any-gpu to "
                           f"compare them anyway")
    points = [Point(k, (), old_pool[k][1], new_pool[k][1]) for k in shared]
    groups, labels = _groups(points)
    return Comparison(old, new, points, groups, labels,
                      [v for k, v in old_pool.items() if k not in new_pool],
                      [v for k, v in new_pool.items() if k not in old_pool],
                      skipped_old, skipped_new, threshold)


# --- rendering -----------------------------------------------------------------------------------

def _us(x: float) -> str:
    return f"{x:.3f}"


def _ratio(x: float) -> str:
    return f"{x:.3f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: int) -> str:
    """tabulate's "simple" table of preformatted strings (fixed-point: never re-parsed into
    ``g`` format); the last ``right`` columns aligned right."""
    align = ["left"] * (len(headers) - right) + ["right"] * right
    return tabulate(rows, headers=list(headers), disable_numparse=True, colalign=align)


def _env(side: Side) -> str:
    rows = [r for _, r in side.rows]
    gpus = ", ".join(sorted({r.device for r in rows if r.device})) or "?"
    versions = ", ".join(f"{v.split('_')[0]} {'/'.join(sorted({getattr(r, v) for r in rows}))}"
                         for v in _VERSIONS)
    return (f"{side.spec} ({len(side.files)} file{'s' * (len(side.files) != 1)}, {len(rows)} "
            f"rows; {gpus}; {versions})")


def _unmatched(rows: list[tuple[str, Row]]) -> list[str]:
    """One line per file and configuration: its num_tokens."""
    by: dict[tuple, list[int]] = {}
    for path, r in rows:
        key = (path, r.op, r.kind, r.implementation, r.timer, r.mode, r.l2,
               json.dumps(r.params, sort_keys=True))
        by.setdefault(key, []).append(r.num_tokens)
    out = []
    for (path, op, kind, impl, timer, mode, l2, params), ts in by.items():
        ps = " ".join(f"{k}={v}" for k, v in json.loads(params).items() if v not in ("", None))
        out.append(f"  {path}: {op} {kind} {impl} {ps} timer={timer} mode={mode} l2={l2} "
                   f"T={','.join(str(t) for t in sorted(ts))}")
    return out


def _skipped(rows: list[tuple[str, Row]]) -> str:
    counts: dict[str, int] = {}
    for _, r in rows:
        why = r.status if not r.ok else "no median"
        counts[why] = counts.get(why, 0) + 1
    return "; ".join(f"{n} x {why}" for why, n in counts.items())


def render(c: Comparison, worst: int) -> str:
    flag = (lambda ratio: "SLOWER" if c.over(ratio) else "") if c.threshold is not None else None
    out = [f"OLD: {_env(c.old)}", f"NEW: {_env(c.new)}",
           "new/old: the median µs per call of the NEW run over the OLD one's (> 1: slower)", ""]
    head = ["op", "config", "T", "old µs", "new µs", "new/old"]
    lines = [[p.old.op, c.labels[p.key], str(p.old.num_tokens), _us(p.old.median_us),
              _us(p.new.median_us), _ratio(p.ratio)] + ([flag(p.ratio)] if flag else [])
             for g in c.groups for p in g.points]
    out += ["per point:", _table(head + (["flag"] if flag else []), lines,
                                 4 + bool(flag)), ""]
    glines = [[g.op, g.label, str(len(g.points)), _ratio(g.geomean),
               _ratio(min(p.ratio for p in g.points)), _ratio(max(p.ratio for p in g.points))]
              + ([flag(g.geomean)] if flag else []) for g in c.groups]
    out += ["per group (geometric mean of new/old over its num_tokens):",
            _table(["op", "config", "points", "geomean", "min", "max"]
                   + (["flag"] if flag else []), glines, 4 + bool(flag)), ""]
    if worst:
        ranked = sorted(c.points, key=lambda p: p.ratio, reverse=True)[:worst]
        wlines = [[p.old.op, c.labels[p.key], str(p.old.num_tokens), _us(p.old.median_us),
                   _us(p.new.median_us), _ratio(p.ratio)] for p in ranked]
        out += [f"the {len(ranked)} worst points:", _table(head, wlines, 4), ""]
    for what, rows in (("only in OLD", c.only_old), ("only in NEW", c.only_new)):
        if rows:
            out += [f"{what}: {len(rows)} points"] + _unmatched(rows)
    for what, rows in (("OLD", c.skipped_old), ("NEW", c.skipped_new)):
        if rows:
            out.append(f"skipped in {what} (status not ok): {len(rows)} rows: {_skipped(rows)}")
    geo = math.exp(sum(math.log(p.ratio) for p in c.points) / len(c.points))
    out.append(f"matched {len(c.points)} points in {len(c.groups)} groups; only in OLD "
               f"{len(c.only_old)}, only in NEW {len(c.only_new)}; skipped OLD "
               f"{len(c.skipped_old)}, NEW {len(c.skipped_new)}; geometric mean of new/old "
               f"{_ratio(geo)}")
    if c.threshold is not None:
        limit = _ratio(1 + c.threshold / 100)
        fp, fg = c.flagged_points, c.flagged_groups
        out.append(f"threshold {c.threshold:g}%: {len(fp)} points and {len(fg)} groups over "
                   f"{limit}" + (" (REGRESSION)" if fp or fg else ""))
    return "\n".join(out)


def _point_dict(c: Comparison, p: Point) -> dict:
    d = {k: json.loads(v) for k, v in p.key}
    head = {k: d.pop(k) for k in ("op", "kind", "implementation", "num_tokens")}
    return {**head, **d, "config": c.labels[p.key], "old_us": p.old.median_us,
            "new_us": p.new.median_us, "ratio": p.ratio, "flagged": c.over(p.ratio),
            "old_device": p.old.device, "new_device": p.new.device}


def write_json(path: str, c: Comparison, command: str) -> None:
    def unmatched(rows):
        return [{"file": f, **{k: json.loads(v) for k, v in identity(r)}} for f, r in rows]
    doc = {"meta": {"command": command, "old": c.old.spec, "new": c.new.spec,
                    "old_files": c.old.files, "new_files": c.new.files,
                    "threshold_pct": c.threshold},
           "points": [_point_dict(c, p) for p in c.points],
           "groups": [{"op": g.op, "config": g.label, "points": len(g.points),
                       "geomean": g.geomean, "flagged": c.over(g.geomean)} for g in c.groups],
           "only_in_old": unmatched(c.only_old), "only_in_new": unmatched(c.only_new),
           "skipped_old": len(c.skipped_old), "skipped_new": len(c.skipped_new)}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")


def write_csv(path: str, c: Comparison) -> None:
    dicts = [_point_dict(c, p) for p in c.points]
    fields = list(dict.fromkeys(k for d in dicts for k in d))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(dicts)


# --- the command ---------------------------------------------------------------------------------

def _percent(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"expected a percentage >= 0 (5 for 5%), got {text!r}")
    return v


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise ValueError(f"expected a whole number >= 0, got {text!r}")
    return v


def main(argv: list[str], prog: str = "kvwrite-bench compare") -> int:
    import argparse
    import shlex

    from .engine import Parser, check_output_path

    p = Parser(prog=prog, description="Compare two runs' --json files point by point: new/old "
                                      "of the median µs per call, its geometric mean per op and "
                                      "configuration, the worst points.")
    p.add_argument("old", metavar="OLD", help="a --json file, a folder of them or a glob "
                                              "(quoted), e.g. docs/data")
    p.add_argument("new", metavar="NEW", help="the same for the run to compare with OLD")

    def typed(fn):
        def parse(text):
            try:
                return fn(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        parse.__name__ = fn.__name__.strip("_")
        return parse
    p.add_argument("--threshold", type=typed(_percent), default=None, metavar="PCT",
                   help="flag points and groups whose new/old exceeds 1 + PCT/100, and exit 1 "
                        "when any does")
    p.add_argument("--worst", type=typed(_count), default=10, metavar="N",
                   help="list the N points of largest new/old (default 10; 0: none)")
    p.add_argument("--any-gpu", action="store_true",
                   help="compare rows measured on different GPUs (refused by default)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the matched points, groups and unmatched points as JSON")
    p.add_argument("--csv", default=None, metavar="PATH", help="write the matched points as CSV")
    args = p.parse_args(argv)
    for flag in ("json", "csv"):
        path = getattr(args, flag)
        if path is not None:
            try:
                check_output_path(f"--{flag}", path)
            except ValueError as e:
                p.error(str(e))
    try:
        c = compare(read_side("OLD", args.old), read_side("NEW", args.new), args.threshold,
                    args.any_gpu)
    except CompareError as e:
        p.error(str(e))
    print(render(c, args.worst))
    if args.json:
        write_json(args.json, c, shlex.join([prog.split()[0], "compare", *argv]))
    if args.csv:
        write_csv(args.csv, c)
    sys.stdout.flush()
    return 1 if c.flagged_points or c.flagged_groups else 0
