"""Render kvwrite-bench JSON files as the markdown tables of docs/performance.md.

    python scripts/perf_tables.py hot-H128-auto.json hot-H128-fp8.json ...

One table per JSON file (one config): a row per num_tokens, for each layout and implementation
the latency in µs and the percentage of the copy bandwidth measured in that run.
"""

from __future__ import annotations

import sys

from kvwrite.bench.report import read_json


def table(path: str) -> str:
    meta, rows = read_json(path)
    impls = meta["implementations"]
    layouts = list(dict.fromkeys(r.layout for r in rows))
    r0 = rows[0]
    lines = [
        f"**H={r0.num_heads} D={r0.head_size} {r0.dtype} kv={r0.kv_cache_dtype}** "
        f"({meta['device_name']}, copy bandwidth {meta['copy_bw_gbps']:.0f} GB/s, L2 {r0.l2}): "
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
                if r is None or r.status != "ok":
                    cells.append("n/a")
                else:
                    cells.append(f"{r.median_us:.2f} ({r.pct_copy_bw:.0f}%)")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
