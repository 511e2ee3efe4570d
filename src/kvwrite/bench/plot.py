"""Latency and bandwidth against num_tokens (log-log) for any op's rows: one line per series
(implementation, or kind:implementation), one column of panels per combination of the point's
other axes that varies over the rows (the layouts of the seed benchmark, say). Needs matplotlib
(``pip install 'kvwrite[plot]'``).

Each series' latency line has its p20-p80 band (shaded) where the rows carry them; a point the
series did not measure (unsupported, skipped, failed) is an ``x`` on the panel's bottom edge at
its num_tokens, so a gap in a line is never silent. Tick labels are plain numbers in one format
on both axes (``0.6``, ``1``, ``2``, never ``6e-01``)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from .report import Row, series_label

__all__ = ["plot_rows", "PlotError", "pyplot", "MAX_PANELS"]

# Panels past this many would be unreadable; the plot refuses (plot a subset of the rows).
MAX_PANELS = 12


class PlotError(RuntimeError):
    pass


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError(
            "--plot needs matplotlib, which is not installed: pip install 'kvwrite[plot]' "
            "(or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt
    return plt


def tick_label(v: float) -> str:
    """One tick format for every axis: plain numbers without an exponent (0.6, 1, 2, 1024,
    131072), at most three significant decimals below 1."""
    if v >= 1 or v <= 0:
        return f"{v:,.0f}".replace(",", "") if float(v).is_integer() else f"{v:.1f}"
    return f"{v:.3g}" if "e" not in f"{v:.3g}" else f"{v:.6f}".rstrip("0")


def _plain_numbers(ax) -> None:
    """Tick labels like 40 and 0.5 instead of 4x10^1 or 6e-01 on log axes: majors, and the
    minors matplotlib labels on an axis spanning less than a decade, in one format
    (:func:`tick_label`)."""
    from matplotlib.ticker import FuncFormatter, LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x, vmin, vmax):
            return tick_label(x)

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: tick_label(v)))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: tick_label(v)))
    ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False))


_NOT_AXES = {"slot_params", "model", "tp"}


def panels(rows: Sequence[Row]) -> tuple[list[str], dict[tuple, list[Row]]]:
    """(the params that vary over the rows, {their values: rows}) in first-seen order."""
    keys = [k for k in dict.fromkeys(k for r in rows for k in r.params) if k not in _NOT_AXES]
    varying = [k for k in keys if len({str(r.params.get(k)) for r in rows}) > 1]
    out: dict[tuple, list[Row]] = {}
    for r in rows:
        out.setdefault(tuple(str(r.params.get(k)) for k in varying), []).append(r)
    return varying, out


def plot_rows(rows: Sequence[Row], path: str, title: str | None = None) -> None:
    """Write the figure to ``path`` (format from its suffix, e.g. .png or .svg)."""
    plt = pyplot()
    if not rows:
        raise PlotError("--plot: there are no rows to plot")
    varying, groups = panels(rows)
    if len(groups) > MAX_PANELS:
        raise PlotError(f"--plot: the rows make {len(groups)} panels ({', '.join(varying)} vary); "
                        f"at most {MAX_PANELS} are drawn: plot fewer points")
    multi_kind = len({r.kind for r in rows}) > 1
    series = list(dict.fromkeys(series_label(r, multi_kind) for r in rows))
    n = len(groups)
    fig, axes = plt.subplots(2, n, figsize=(5.5 * n, 8), squeeze=False, sharex=True)
    copy_bw = next((r.copy_bw_gbps for r in rows if not math.isnan(r.copy_bw_gbps)), math.nan)
    for col, (values, group) in enumerate(groups.items()):
        lat_ax, bw_ax = axes[0][col], axes[1][col]
        for s in series:
            mine = [r for r in group if series_label(r, multi_kind) == s]
            pts = sorted((r.num_tokens, r.latency_us, r.gbps, r.p20_us, r.p80_us) for r in mine
                         if not math.isnan(r.latency_us))
            missed = sorted({r.num_tokens for r in mine if math.isnan(r.latency_us)})
            color = None
            if pts:
                t, lat, gbps, p20, p80 = zip(*pts, strict=True)
                (line,) = lat_ax.plot(t, lat, marker="o", markersize=3, label=s)
                color = line.get_color()
                bw_ax.plot(t, gbps, marker="o", markersize=3, label=s, color=color)
                band = [(x, lo, hi) for x, lo, hi in zip(t, p20, p80, strict=True)
                        if not (math.isnan(lo) or math.isnan(hi))]
                if band:
                    bt, lo, hi = zip(*band, strict=True)
                    lat_ax.fill_between(bt, lo, hi, color=color, alpha=0.2, linewidth=0)
            if missed:
                # On the bottom edge (axes coordinates in y): where this series has no number.
                for ax in (lat_ax, bw_ax):
                    ax.scatter(missed, [0.02] * len(missed), marker="x", color=color,
                               transform=ax.get_xaxis_transform(), clip_on=False,
                               label=f"{s}: not measured" if ax is lat_ax else None)
        if not math.isnan(copy_bw):
            bw_ax.axhline(copy_bw, color="gray", linestyle="--", linewidth=1,
                          label=f"copy bandwidth ({copy_bw:.0f} GB/s)")
        for ax in (lat_ax, bw_ax):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            _plain_numbers(ax)
        lat_ax.set_title(textwrap.fill(" ".join(values) or rows[0].op, width=40), fontsize=9)
        lat_ax.set_ylabel("latency per call (µs; band: p20-p80)")
        bw_ax.set_ylabel("GB/s (bytes read + written)")
        bw_ax.set_xlabel("num_tokens")
        lat_ax.legend(fontsize=8)
        bw_ax.legend(fontsize=8)
    r = rows[0]
    title = title or f"{r.op} | {r.timer} timer, {r.mode}, L2 {r.l2} | {r.device}"
    # Wrapped to the figure's width (about 12 characters an inch at this size), never cut off.
    fig.suptitle(textwrap.fill(title, width=int(12 * 5.5 * n)), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
