"""One row schema for every op's benchmark, and its renderings: the console table, JSON, CSV.

A :class:`Row` is one measurement: one implementation of one kind of call (an op's benchmark may
time several kinds at a point, e.g. the fused RoPE write, the unfused pair and RoPE alone) at one
point. The fields every op shares are attributes; the point's own axes (layout, dtypes, heads,
block size, slot pattern, ...) are ``params`` and are written flat beside them in JSON and CSV,
so a file reads back into the same rows whatever op wrote it (:func:`read_json`).

The console table is what vLLM's benchmarks print: ``tabulate``'s "simple" format, with the
numbers fixed-point as formatted (never scientific notation), right-aligned.

JSON: ``{"meta": {...}, "rows": [...]}``, with ``meta["command"]`` the command line that
reproduces the run; NaN is written as null. CSV: one line per row (the union of the rows' keys
as columns) plus a last ``command`` column holding that command line.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
from collections.abc import Sequence

from tabulate import tabulate

__all__ = ["Row", "COMMON_FIELDS", "MEASURED_PARAMS", "format_table", "write_json", "write_csv",
           "read_json", "row_dicts", "series_label", "ReportError"]

NAN = float("nan")


class ReportError(ValueError):
    """A file that is not a kvwrite-bench JSON file; the message names the file."""


@dataclasses.dataclass
class Row:
    """One measurement (see the module doc); ``params`` are the point's axes."""

    op: str                    # the benchmark (subcommand) that measured it
    kind: str                  # what was timed at the point (the op's name for single-kind ops)
    implementation: str        # a registered implementation: cuda, triton, torch, ...
    num_tokens: int
    params: dict               # the point's other axes: layout, dtypes, shape, slots, ...
    timer: str = "device"      # device, host-sync or cpu
    mode: str = "cudagraph"    # cudagraph or no_graph (what was measured)
    l2: str = "rotated"        # rotated, hot or n/a (CPU)
    rotation_sets: int = 0     # distinct input sets the calls rotate over
    calls_per_sample: int = 0
    samples: int = 0
    latency_us: float = NAN    # the table's number: median, or the mean for host-sync (vLLM's)
    median_us: float = NAN
    p20_us: float = NAN
    p80_us: float = NAN
    mean_us: float = NAN
    bytes: int = 0             # bytes one call must move (the op's count)
    gbps: float = NAN          # bytes / median, in 1e9 bytes/s
    pct_copy_bw: float = NAN   # gbps / the copy bandwidth measured in this run, in %
    copy_bw_gbps: float = NAN
    check: str = "skipped"     # passed, failed or skipped
    status: str = "ok"         # ok, or "unsupported: ...", "mismatch: ...", "skipped: ...", "error: ..."
    device: str = ""           # GPU name, or "cpu"
    torch_version: str = ""
    triton_version: str = ""
    cuda_version: str = ""
    kvwrite_version: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def __getattr__(self, name: str):
        # The point's axes read like fields (row.layout, row.num_heads); only called for names
        # that are not attributes.
        params = self.__dict__.get("params")
        if params is not None and name in params:
            return params[name]
        raise AttributeError(f"{type(self).__name__} has no field or param {name!r}")

    def to_dict(self) -> dict:
        """The flat record written to JSON and CSV: identity, params, then the measurement."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "params"}
        head = {k: d.pop(k) for k in ("op", "kind", "implementation", "num_tokens")}
        clash = set(self.params) & set(d) | set(self.params) & set(head)
        if clash:
            raise ValueError(f"params: {sorted(clash)} are Row fields, not params")
        return {**head, **self.params, **d}


COMMON_FIELDS = [f.name for f in dataclasses.fields(Row) if f.name != "params"]
# Params a benchmark measures beside the time (transfer's limit and NCCL figure of the run, host
# time and overlap figures): a row's values, never what was measured (not a table axis, not a
# point's identity).
MEASURED_PARAMS = frozenset({"limit_gbps", "nccl_gbps", "host_us", "attention_us",
                             "attention_overlapped_us", "attention_repeat", "attention_slowdown",
                             "attention_slowdown_low", "attention_slowdown_high",
                             "transfer_overlapped_us"})
_FLOATS = {f.name for f in dataclasses.fields(Row) if f.type in ("float", float)}


def series_label(row: Row, multi_kind: bool) -> str:
    """What a table column or a plot line is called: the implementation, or kind:implementation
    when the rows time several kinds."""
    return f"{row.kind}:{row.implementation}" if multi_kind else row.implementation


_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+|nan|inf)x?$", re.I)


def _cell(v) -> str:
    """A cell's text: strings as given (the caller's fixed-point format), floats fixed-point
    (``g`` where that has no exponent, else 3 decimals), never scientific notation."""
    if isinstance(v, float):
        text = f"{v:g}"
        return f"{v:.3f}" if "e" in text else text
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """``tabulate``'s "simple" format (vLLM's benchmark prints it) with the numbers as the
    caller formatted them: fixed-point, never re-read (tabulate would print 1005980.123 as
    1.00598e+06). A column of numbers (or nan) is right-aligned, any other left-aligned."""
    cells = [[_cell(v) for v in line] for line in rows]
    ncols = max([len(headers)] + [len(line) for line in cells])
    align = ["right" if cells and all(i >= len(line) or _NUMBER.match(line[i].strip())
                                       for line in cells) else "left" for i in range(ncols)]
    return tabulate(cells, headers=list(headers), disable_numparse=True, colalign=align)


# --- files ---------------------------------------------------------------------------------------

def _json_value(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def row_dicts(rows: Sequence) -> list[dict]:
    """Flat records of ``rows`` (:class:`Row` or any dataclass rows, as the probes write)."""
    return [r.to_dict() if isinstance(r, Row) else dataclasses.asdict(r) for r in rows]


def write_json(path: str, rows: Sequence, meta: dict) -> None:
    """``{meta, rows}``; NaN written as null."""
    doc = {"meta": meta,
           "rows": [{k: _json_value(v) for k, v in d.items()} for d in row_dicts(rows)]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")


def read_json(path: str) -> tuple[dict, list[Row]]:
    """(meta, rows) of a file :func:`write_json` wrote for any op; null numbers read back as NaN.
    Raises OSError where the file cannot be read, ReportError (naming the file) where it is not
    such a file."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except ValueError as e:
            raise ReportError(f"{path}: expected a JSON file written by --json, got one that does "
                              f"not parse as JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ReportError(f"{path}: expected a kvwrite-bench JSON file with 'meta' and 'rows'")
    rows = []
    need = ("implementation", "num_tokens", "latency_us", "status")
    for i, d in enumerate(doc["rows"]):
        if not isinstance(d, dict) or any(k not in d for k in need):
            raise ReportError(f"{path}: row {i} is not a benchmark measurement (it lacks one of "
                              f"{list(need)}); probes' files are not read here")
        fields = {k: (NAN if v is None and k in _FLOATS else v) for k, v in d.items()
                  if k in COMMON_FIELDS}
        fields.setdefault("op", doc.get("meta", {}).get("op", "reshape_and_cache_flash"))
        fields.setdefault("kind", fields["op"])
        params = {k: v for k, v in d.items() if k not in COMMON_FIELDS}
        rows.append(Row(params=params, **fields))
    return doc.get("meta", {}), rows


def write_csv(path: str, rows: Sequence, command: str) -> None:
    """One line per row (the union of the rows' keys as columns, in first-seen order) and a last
    ``command`` column."""
    dicts = row_dicts(rows)
    fields = list(dict.fromkeys(k for d in dicts for k in d)) + ["command"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for d in dicts:
            w.writerow({**d, "command": command})
