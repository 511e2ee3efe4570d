"""``kvwrite-bench report FILE.json...``: saved ``--json`` results of any subcommand as markdown
tables (docs/performance.md's tables are this command's output over the committed JSON files:
``kvwrite-bench report --into docs/performance.md docs/data/*.json``).

A file's rows are split into tables by the axes that vary over them (all but num_tokens and the
layout); a table has a row per num_tokens and, for each layout and series (implementation, or
kind:implementation), the latency in µs and the percentage of the copy bandwidth measured in
that run (``n/a`` where a row was not measured). A benchmark whose definition sets
``report_split`` (transfer: figures against the limit of each row's direction) is tabulated as it
says instead: a table per value of those params, a line per point, and per num_tokens and series
the cells of its ``report_columns``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

from .report import MEASURED_PARAMS, ReportError, Row, read_json, series_label

__all__ = ["markdown_tables", "main", "MARKER"]

_QUIET = {"slot_params", "model", "tp"}
MARKER = "<!-- generated:"


def _fmt(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items()
                    if k not in _QUIET and v not in ("", None, False))


def _definition(name: str):
    """The benchmark definition of subcommand ``name`` (an op's registered BenchCommand, by name or
    alias), or None (a file of an unknown one)."""
    import importlib

    from .. import (
        ops,  # noqa: F401  (every op registered)
        registry,
    )

    for op in registry.ops():
        command = registry.get_op(op).bench
        if command is not None and name in (command.name, *command.aliases):
            module, attr = command.target.split(":")
            return getattr(importlib.import_module(module), attr)
    return None


def markdown_tables(meta: dict, rows: Sequence[Row]) -> str:
    """The markdown tables of one file's ``meta`` and ``rows``."""
    if not rows:
        raise ReportError("rows: expected at least one measurement, got none")
    defn = _definition(meta.get("op", rows[0].op))
    if defn is not None and defn.report_split is not None:
        return _point_tables(defn, meta, rows)
    keys = list(dict.fromkeys(k for r in rows for k in r.params if k not in MEASURED_PARAMS))
    varying = [k for k in keys if len({str(r.params.get(k)) for r in rows}) > 1]

    def follows_t(k: str) -> bool:  # one value per num_tokens (a cache sized for T): no split
        per_t: dict[int, set] = {}
        for r in rows:
            per_t.setdefault(r.num_tokens, set()).add(str(r.params.get(k)))
        return all(len(v) == 1 for v in per_t.values())
    split = [k for k in varying if k != "layout" and not follows_t(k)]
    fixed = {k: rows[0].params.get(k) for k in keys if k not in varying}
    multi_kind = len({r.kind for r in rows}) > 1
    series = list(dict.fromkeys(series_label(r, multi_kind) for r in rows))
    r0 = rows[0]
    device = meta.get("device_name", r0.device)
    op = meta.get("op", r0.op)
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault(tuple(str(r.params.get(k)) for k in split), []).append(r)
    command = re.sub(r" --json \S+", "", meta.get("command", ""))
    out = [f"`{command}`"] if command else []
    for values, group in groups.items():
        layouts = list(dict.fromkeys(str(r.params.get("layout", "")) for r in group))
        what = " ".join(f"{k}={v}" for k, v in zip(split, values, strict=True))
        head = f"**{op}: {_fmt(fixed)}{' ' + what if what else ''}**"
        cols = [(lo, s) for lo in layouts for s in series]
        lines = [f"{head} ({device}, copy bandwidth {r0.copy_bw_gbps:.0f} GB/s, {r0.timer} timer, "
                 f"L2 {r0.l2}): µs per call (% of copy bandwidth)", "",
                 "| T | " + " | ".join(f"{lo} {s}".strip() for lo, s in cols) + " |",
                 "|---:|" + "---:|" * len(cols)]
        by = {(r.num_tokens, str(r.params.get("layout", "")), series_label(r, multi_kind)): r
              for r in group}
        for t in sorted({r.num_tokens for r in group}):
            cells = []
            for lo, s in cols:
                r = by.get((t, lo, s))
                cells.append("n/a" if r is None or not r.ok
                             else f"{r.median_us:.2f} ({r.pct_copy_bw:.0f}%)")
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _value(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def _point_tables(defn, meta: dict, rows: Sequence[Row]) -> str:
    """``defn.report_split``'s tables: a table per value of the split params (a heading with
    every param that is one value over it), a line per point (the definition's point columns
    that vary over the table) and, per num_tokens and series, ``defn.report_columns``' cells."""
    multi_kind = len({r.kind for r in rows}) > 1
    series = list(dict.fromkeys(series_label(r, multi_kind) for r in rows))
    tokens = sorted({r.num_tokens for r in rows})
    t_head = dict(defn.columns).get("num_tokens", "T")
    r0 = rows[0]
    device = meta.get("device_name", r0.device)
    command = re.sub(r" --json \S+", "", meta.get("command", ""))
    out = [f"`{command}`"] if command else []
    labels = [k for k, _ in defn.columns if k != "num_tokens" and k not in defn.report_split]
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault(tuple(str(r.params.get(k)) for k in defn.report_split), []).append(r)
    for group in groups.values():
        shown = [k for k in labels if len({str(r.params.get(k)) for r in group}) > 1]
        # The group's constant params, a measured one too (the run's limit of its direction).
        fixed = {k: v for k, v in group[0].params.items()
                 if k not in shown and v not in ("", None, False)
                 and all(str(r.params.get(k)) == str(v) for r in group)}
        cols = defn.report_columns(group)
        lines: dict[tuple, dict] = {}
        for r in group:
            key = tuple(str(r.params.get(k)) for k in shown)
            lines.setdefault(key, {})[(r.num_tokens, series_label(r, multi_kind))] = r
        heads = [h for _, h in defn.columns if _ in shown]
        heads += [f"{t_head} {t} {s} {h}" for t in tokens for s in series for h, _ in cols]
        text = [f"**{defn.name}: {' '.join(f'{k}={_value(v)}' for k, v in fixed.items())}** "
                f"({device}, {r0.timer} timer, L2 {r0.l2})", "",
                "| " + " | ".join(heads) + " |",
                "|" + ":---|" * len(shown) + "---:|" * (len(heads) - len(shown))]
        for key, by in lines.items():
            cells = list(key)
            for t in tokens:
                for s in series:
                    r = by.get((t, s))
                    cells += [fn(r) if r is not None and r.ok else "n/a" for _, fn in cols]
            text.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(text))
    return "\n\n".join(out)


def main(argv: list[str], prog: str = "kvwrite-bench report") -> int:
    from .engine import Parser

    p = Parser(prog=prog, description="Print files written by any kvwrite-bench subcommand's "
                                      "--json as markdown tables.")
    p.add_argument("json", nargs="+", help="files written by kvwrite-bench ... --json")
    p.add_argument("--into", metavar="PAGE.md", default=None,
                   help="replace everything after the page's marker line (a line starting with "
                        f"{MARKER!r}) with the tables, instead of printing them")
    args = p.parse_args(argv)
    head = None
    if args.into:
        try:
            with open(args.into) as f:
                text = f.read()
        except OSError as e:
            p.error(f"--into: {args.into}: cannot read it ({e.strerror or e})")
        at = text.find("\n" + MARKER)
        if at < 0:
            p.error(f"--into: {args.into} has no line starting with {MARKER!r}")
        head = text[:text.index("\n", at + 1) + 1]
    tables = []
    for path in args.json:
        try:
            tables.append(markdown_tables(*read_json(path)))
        except OSError as e:
            print(f"{prog}: error: {path}: cannot read it ({e.strerror or e})", file=sys.stderr)
            return 2
        except ReportError as e:
            text = str(e)
            print(f"{prog}: error: {text if text.startswith(path) else f'{path}: {text}'}",
                  file=sys.stderr)
            return 2
    body = "\n\n".join(tables)
    if head is None:
        print(body)
    else:
        with open(args.into, "w") as f:
            f.write(head + "\n" + body + "\n")
    return 0
