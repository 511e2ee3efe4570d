"""Latency and bandwidth against num_tokens (log-log): one line per implementation, one column
of panels per layout. Needs matplotlib (``pip install 'kvwrite[plot]'``)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from .report import Row

__all__ = ["plot_rows", "PlotError"]


class PlotError(RuntimeError):
    pass


def _pyplot():
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


def _plain_numbers(ax) -> None:
    """Tick labels like 40 and 0.5 instead of 4x10^1 on log axes spanning less than a decade."""
    from matplotlib.ticker import FuncFormatter, LogFormatter
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    # Labels some minor ticks only when the axis spans few decades (matplotlib's rule).
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))


def _unique(values) -> list:
    return list(dict.fromkeys(values))


def plot_rows(rows: Sequence[Row], path: str, title: str | None = None) -> None:
    """Write the figure to ``path`` (format from its suffix, e.g. .png or .svg)."""
    plt = _pyplot()
    if not rows:
        raise PlotError("--plot: there are no rows to plot")
    layouts = _unique(r.layout for r in rows)
    impls = _unique(r.implementation for r in rows)
    fig, axes = plt.subplots(2, len(layouts), figsize=(5.5 * len(layouts), 8), squeeze=False,
                             sharex=True)
    copy_bw = next((r.copy_bw_gbps for r in rows if not math.isnan(r.copy_bw_gbps)), math.nan)
    for col, layout in enumerate(layouts):
        lat_ax, bw_ax = axes[0][col], axes[1][col]
        for impl in impls:
            pts = sorted((r.num_tokens, r.latency_us, r.gbps) for r in rows
                         if r.layout == layout and r.implementation == impl
                         and not math.isnan(r.latency_us))
            if not pts:
                continue
            t, lat, gbps = zip(*pts, strict=True)
            lat_ax.plot(t, lat, marker="o", markersize=3, label=impl)
            bw_ax.plot(t, gbps, marker="o", markersize=3, label=impl)
        if not math.isnan(copy_bw):
            bw_ax.axhline(copy_bw, color="gray", linestyle="--", linewidth=1,
                          label=f"copy bandwidth ({copy_bw:.0f} GB/s)")
        for ax in (lat_ax, bw_ax):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            _plain_numbers(ax)
        lat_ax.set_title(layout)
        lat_ax.set_ylabel("latency per call (µs)")
        bw_ax.set_ylabel("GB/s (bytes read + written)")
        bw_ax.set_xlabel("num_tokens")
        lat_ax.legend(fontsize=8)
        bw_ax.legend(fontsize=8)
    r = rows[0]
    title = title or (
        f"reshape_and_cache_flash: H={r.num_heads} D={r.head_size} bs={r.block_size} {r.dtype} "
        f"kv={r.kv_cache_dtype} | slots {r.slot_params} | {r.timer} timer, {r.mode}, L2 {r.l2} | {r.device}"
    )
    # Wrapped to the figure's width (about 12 characters an inch at this size), never cut off.
    fig.suptitle(textwrap.fill(title, width=int(12 * 5.5 * len(layouts))), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
