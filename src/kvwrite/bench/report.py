"""One row schema and its renderings: the console table, JSON and CSV.

The console table is what vLLM's benchmark prints: ``tabulate`` with its defaults ("simple"
format; numbers in ``g`` format, aligned on the decimal point).

JSON: ``{"meta": {...}, "rows": [...]}``, with ``meta["command"]`` the command line that
reproduces the run; NaN is written as null. CSV: one line per row with the :class:`Row` fields
as columns, plus a last ``command`` column holding that command line.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Iterable, Sequence

from tabulate import tabulate

__all__ = ["Row", "ROW_FIELDS", "CSV_FIELDS", "format_table", "seed_table", "compare_table",
           "notes", "write_json", "write_csv", "read_json"]

NAN = float("nan")


@dataclasses.dataclass
class Row:
    """One measurement: one implementation at one (layout, num_tokens) point."""

    implementation: str
    layout: str                # NHD, HND or packed
    dtype: str                 # key/value dtype
    kv_cache_dtype: str
    num_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    num_tokens: int
    per_head_scale: bool
    model: str                 # preset name, "" when none
    tp: int
    slots: str                 # slot pattern: random, decode, prefill or mixed (bench.slots)
    slot_params: str           # the pattern with its parameters, e.g. decode(context_len=4096)
    pad_fraction: float        # fraction of the slots that are -1 padding
    timer: str                 # device, host-sync or cpu
    mode: str                  # cudagraph or no_graph (what was measured)
    l2: str                    # rotated, hot or n/a (CPU)
    rotation_sets: int         # distinct input sets the calls rotate over
    calls_per_sample: int
    samples: int
    latency_us: float          # the table's number: median, or the mean for host-sync (vLLM's)
    median_us: float
    p20_us: float
    p80_us: float
    mean_us: float
    bytes: int                 # 2*N*H*D*(in_bytes + cache_bytes) + T*slot_bytes, N = T - padding
    gbps: float                # bytes / median, in 1e9 bytes/s
    pct_copy_bw: float         # gbps / the copy bandwidth measured in this run, in %
    copy_bw_gbps: float
    check: str                 # passed, failed or skipped
    status: str                # ok, or "unsupported: ...", "mismatch: ...", "skipped: ...", "error: ..."
    device: str                # GPU name, or "cpu"
    torch_version: str
    triton_version: str
    cuda_version: str
    kvwrite_version: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


ROW_FIELDS = [f.name for f in dataclasses.fields(Row)]
CSV_FIELDS = ROW_FIELDS + ["command"]


# --- the console table ---------------------------------------------------------------------------

def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """``tabulate(rows, headers)`` with its defaults ("simple" format, numbers parsed): the format
    vLLM's benchmark prints."""
    return tabulate(rows, headers=list(headers))


def _us(x: float) -> str:
    # vLLM prints f"{seconds * 1e6:.3f}" and tabulate re-reads it as a number.
    return f"{x:.3f}"


def seed_table(rows: Sequence[Row], verbose: bool = False) -> str:
    """One implementation: vLLM's three columns (plus spread and bandwidth with ``verbose``)."""
    headers = ["num_tokens", "layout", "latency (µs)"]
    if verbose:
        headers += ["p20 (µs)", "p80 (µs)", "GB/s", "% copy BW", "status"]
    body = []
    for r in rows:
        line = [r.num_tokens, r.layout, _us(r.latency_us)]
        if verbose:
            line += [_us(r.p20_us), _us(r.p80_us), f"{r.gbps:.1f}", f"{r.pct_copy_bw:.1f}",
                     r.status.split(":")[0]]
        body.append(line)
    return format_table(headers, body)


def compare_table(rows: Sequence[Row], impls: Sequence[str], baseline: str,
                  verbose: bool = False) -> str:
    """Several implementations: one line per (layout, num_tokens), a latency column each, and
    each one's speedup over ``baseline`` (baseline latency / its latency)."""
    by_key: dict[tuple[str, int], dict[str, Row]] = {}
    for r in rows:
        by_key.setdefault((r.layout, r.num_tokens), {})[r.implementation] = r
    others = [i for i in impls if i != baseline]
    headers = ["num_tokens", "layout"] + [f"{i} (µs)" for i in impls]
    headers += [f"{i} vs {baseline}" for i in others]
    if verbose:
        headers += [f"{i} % copy BW" for i in impls]
    body = []
    for (layout, t), per in by_key.items():
        lat = {i: per[i].latency_us if i in per else NAN for i in impls}
        line = [t, layout] + [_us(lat[i]) for i in impls]
        line += [f"{lat[baseline] / lat[i]:.2f}" for i in others]
        if verbose:
            line += [f"{per[i].pct_copy_bw:.1f}" if i in per else "nan" for i in impls]
        body.append(line)
    return format_table(headers, body)


def _ranges(values: Iterable[int]) -> str:
    v = sorted(set(values))
    return ", ".join(map(str, v)) if len(v) <= 4 else f"{v[0]}..{v[-1]} ({len(v)} points)"


def notes(rows: Sequence[Row]) -> list[str]:
    """One line per (implementation, layout, reason) for every row that was not measured."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for r in rows:
        if not r.ok:
            groups.setdefault((r.implementation, r.layout, r.status), []).append(r.num_tokens)
    return [f"{impl} {layout} num_tokens {_ranges(ts)}: {status}"
            for (impl, layout, status), ts in groups.items()]


# --- files ---------------------------------------------------------------------------------------

def _json_value(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def write_json(path: str, rows: Sequence, meta: dict) -> None:
    """``{meta, rows}``; rows are dataclasses (any op's row type)."""
    doc = {"meta": meta,
           "rows": [{k: _json_value(v) for k, v in dataclasses.asdict(r).items()} for r in rows]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")


def read_json(path: str) -> tuple[dict, list[Row]]:
    """(meta, rows) of a file :func:`write_json` wrote; null numbers read back as NaN."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "rows" not in doc:
        raise ValueError(f"{path}: expected a kvwrite-bench JSON file with 'meta' and 'rows'")
    floats = {f.name for f in dataclasses.fields(Row) if f.type in ("float", float)}
    rows = []
    for d in doc["rows"]:
        missing = [k for k in ROW_FIELDS if k not in d]
        if missing:
            raise ValueError(f"{path}: a row lacks the fields {missing}")
        rows.append(Row(**{k: (NAN if d[k] is None and k in floats else d[k]) for k in ROW_FIELDS}))
    return doc.get("meta", {}), rows


def write_csv(path: str, rows: Sequence, command: str) -> None:
    """One line per row (any dataclass rows of one type; :class:`Row` by default) and a last
    ``command`` column."""
    fields = ([f.name for f in dataclasses.fields(rows[0])] + ["command"]) if rows else CSV_FIELDS
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({**dataclasses.asdict(r), "command": command})
