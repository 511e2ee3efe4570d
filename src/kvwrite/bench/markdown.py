"""``kvwrite-bench report FILE.json...``: saved ``--json`` results as the markdown tables of
docs/performance.md.

One table per file (one configuration): a row per num_tokens, for each layout and implementation
the latency in µs and the percentage of the copy bandwidth measured in that run (``n/a`` where a
row was not measured).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .report import Row, read_json

__all__ = ["markdown_table", "main"]


def markdown_table(meta: dict, rows: Sequence[Row]) -> str:
    """The markdown table of one file's ``meta`` and ``rows``."""
    if not rows:
        raise ValueError("rows: expected at least one measurement, got none")
    impls = meta.get("implementations") or list(dict.fromkeys(r.implementation for r in rows))
    layouts = list(dict.fromkeys(r.layout for r in rows))
    r0 = rows[0]
    device = meta.get("device_name", r0.device)
    lines = [
        f"**H={r0.num_heads} D={r0.head_size} {r0.dtype} kv={r0.kv_cache_dtype}** "
        f"({device}, copy bandwidth {r0.copy_bw_gbps:.0f} GB/s, L2 {r0.l2}): "
        "µs per call (% of copy bandwidth)",
        "",
        "| T | " + " | ".join(f"{lo} {i}" for lo in layouts for i in impls) + " |",
        "|---:|" + "---:|" * (len(layouts) * len(impls)),
    ]
    by = {(r.num_tokens, r.layout, r.implementation): r for r in rows}
    for t in sorted({r.num_tokens for r in rows}):
        cells = []
        for lo in layouts:
            for i in impls:
                r = by.get((t, lo, i))
                cells.append("n/a" if r is None or not r.ok
                             else f"{r.median_us:.2f} ({r.pct_copy_bw:.0f}%)")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str], prog: str = "kvwrite-bench report") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Print files written by kvwrite-bench "
                                "--json as markdown tables (one per file).")
    p.add_argument("json", nargs="+", help="files written by kvwrite-bench --json")
    args = p.parse_args(argv)
    tables = []
    for path in args.json:
        try:
            tables.append(markdown_table(*read_json(path)))
        except (OSError, ValueError) as e:
            print(f"{prog}: error: {path}: {e}", file=sys.stderr)
            return 2
    print("\n\n".join(tables))
    return 0
