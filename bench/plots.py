"""What the bench scripts' ``--plot`` PNGs share: a headless pyplot, and latency CDFs.

matplotlib comes from the ``plot`` extra and is imported only when a plot is asked for,
so a bench run without it never pays for (or needs) it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdfs(ax: Any, samples: Mapping[str, Sequence[float]], *, xlabel: str,
                 ylabel: str, title: str, legend_size: float | None = None) -> None:
    """Draw one step CDF per key of ``samples`` (seconds, shown in ms on a log axis), each
    labelled with its p50, onto the matplotlib axes ``ax``."""
    for key, values in samples.items():
        xs = sorted(v * 1000 for v in values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{key} (p50 {statistics.median(xs):.1f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size, loc="lower right")
