"""Prometheus metrics for fiberd, in a registry of their own, built only when asked.

``FiberMetrics`` tallies clone outcomes (started per grant, missed per miss
code), latencies, fiber ends per grant and end reason (``END_REASONS``) and
refusals in plain counters, and says which build runs (``slurm_fiber_build_info``).

- Grant labels are bounded: past ``MAX_GRANTS`` distinct grants, further ones count
  under ``grant="_other"``; a miss is labelled by its code only (its grant may be one
  the caller made up).
- prometheus-client is imported the first time the metrics are read (``registry``,
  ``render``), so a fiberd nobody scrapes never loads it (core/runtime/memory.py).
- The registry is private: two daemons in one process never collide and nothing
  leaks into prometheus-client's global registry.
- ``render()`` rebuilds the exposition at most once every ``RENDER_INTERVAL`` seconds
  (``Rendered``), however often it is asked for (``renders`` counts the real ones).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from slurm_fiber.core.book.misses import MissCode
from slurm_fiber.core.fibers.fiber import FiberEnd, FiberState
from slurm_fiber.version import version

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

# Clone round trips are milliseconds; the tail reaches seconds when a template is large.
CLONE_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # prometheus-client's, unimported
# How a fiber ended, as people query it (``end_reason``).
END_REASONS = ("ok", "failed", "deadline", "oom", "killed", "lost")
MAX_GRANTS = 256  # distinct grant label values; more count as OTHER_GRANT
OTHER_GRANT = "_other"
RENDER_INTERVAL = 1.0  # seconds an exposition is served again before it is rebuilt


def end_reason(end: FiberEnd | None, mode: str) -> str:
    """How a fiber ended, one of END_REASONS: ``lost`` (no status: its template died),
    ``oom`` (the kernel's OOM killer), ``deadline`` (its deadline or lease end),
    ``killed`` (fiberd ended it otherwise: stop, fence, grant removed, epoch, shutdown;
    or a SIGKILL from outside), ``ok`` (exit 0, and in call mode a result), else
    ``failed``. Pure."""
    if end is None or end.state is FiberState.LOST:
        return "lost"
    code = end.reason.code if end.reason is not None else None
    if code == "template_lost":
        return "lost"
    if code == "oom":
        return "oom"
    if code in ("deadline", "lease_end"):
        return "deadline"
    if code is not None:
        return "killed"
    record = end.result or {}
    if end.exit_code != 0 or "exec_failed" in record or "error" in record:
        return "failed"
    if mode == "call" and record.get("ok") is not True:
        return "failed"
    return "ok"


class Rendered:
    """``make()``'s bytes, made again only once ``interval`` seconds have passed since the
    last time (``now`` is a monotonic clock); ``count`` is how many times it was made."""

    def __init__(self, make: Callable[[], bytes], interval: float = RENDER_INTERVAL,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.make = make
        self.interval = interval
        self.now = now
        self.count = 0
        self._text = b""
        self._at: float | None = None

    def get(self) -> bytes:
        at = self.now()
        if self._at is None or at - self._at >= self.interval or at < self._at:
            self._text = self.make()
            self._at = at
            self.count += 1
        return self._text


class FiberMetrics:
    """The daemon's metrics. Recording methods never block and never raise for valid input.

    ``running`` is called at each scrape to read how many fibers run now.
    """

    def __init__(self, running: Callable[[], int] = lambda: 0,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._running = running
        self._clones: Counter[str] = Counter()  # by grant
        self._ends: Counter[tuple[str, str]] = Counter()  # by (grant, reason)
        self._grants: set[str] = set()
        self._misses: Counter[str] = Counter({code.value: 0 for code in MissCode})
        self._refusals: Counter[str] = Counter()
        self._buckets = [0] * (len(CLONE_LATENCY_BUCKETS) + 1)  # per bucket, +Inf last
        self._latency_sum = 0.0
        self._registry: CollectorRegistry | None = None
        self._rendered = Rendered(self._render, now=now)

    @property
    def renders(self) -> int:
        """How many expositions ``render`` has really built (not served again)."""
        return self._rendered.count

    def grant_label(self, grant: str) -> str:
        """``grant`` as a label value: itself for the first MAX_GRANTS grants seen, then
        OTHER_GRANT."""
        if grant in self._grants:
            return grant
        if len(self._grants) >= MAX_GRANTS:
            return OTHER_GRANT
        self._grants.add(grant)
        for reason in END_REASONS:  # every reason present from the grant's first sample
            self._ends[(grant, reason)] += 0
        self._clones[grant] += 0
        return grant

    def clone_started(self, seconds: float, grant: str = "") -> None:
        """Record a clone of ``grant`` that started a fiber after ``seconds``."""
        self._clones[self.grant_label(grant)] += 1
        self._observe(seconds)

    def fiber_ended(self, grant: str, end: FiberEnd | None, mode: str) -> None:
        """Record the end of a fiber of ``grant`` (``end_reason``)."""
        self._ends[(self.grant_label(grant), end_reason(end, mode))] += 1

    def clone_missed(self, code: MissCode, seconds: float) -> None:
        """Record a clone that missed with ``code`` after ``seconds``."""
        self._misses[code.value] += 1
        self._observe(seconds)

    def refused(self, code: str) -> None:
        """Record a refused request (an error reply) with its error code."""
        self._refusals[code] += 1

    @property
    def registry(self) -> CollectorRegistry:
        """The prometheus registry (imports prometheus-client on first use)."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry

            self._registry = CollectorRegistry(auto_describe=True)
            self._registry.register(_Families(self))
        return self._registry

    def render(self) -> str:
        """The Prometheus text exposition of every metric, rebuilt at most every
        RENDER_INTERVAL seconds (module doc)."""
        return self._rendered.get().decode()

    def _render(self) -> bytes:
        from prometheus_client.exposition import generate_latest

        return generate_latest(self.registry)

    def _observe(self, seconds: float) -> None:
        self._buckets[bisect.bisect_left(CLONE_LATENCY_BUCKETS, seconds)] += 1
        self._latency_sum += seconds

    def families(self) -> Iterator[Metric]:
        """The metric families of the tallies now (the registry's collector)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        info = GaugeMetricFamily("slurm_fiber_build_info",
                                 "The running slurm_fiber's version and Python (always 1).",
                                 labels=["version", "python"])
        import platform  # at the first scrape, as prometheus-client

        info.add_metric([version(), platform.python_version()], 1.0)
        yield info
        clones = CounterMetricFamily("slurm_fiber_clones",
                                     "Clones that started a fiber, by grant.", labels=["grant"])
        for grant, count in self._clones.items():
            clones.add_metric([grant], count)
        yield clones
        ends = CounterMetricFamily(
            "slurm_fiber_fiber_ends",
            "Fibers that ended, by grant and reason (ok, failed, deadline, oom, killed, lost).",
            labels=["grant", "reason"])
        for (grant, reason), count in self._ends.items():
            ends.add_metric([grant, reason], count)
        yield ends
        misses = CounterMetricFamily("slurm_fiber_clone_misses",
                                     "Clones that started nothing, by miss code.", labels=["code"])
        for code, count in self._misses.items():
            misses.add_metric([code], count)
        yield misses
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, CLONE_LATENCY_BUCKETS), "+Inf"), self._buckets,
                                strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        yield HistogramMetricFamily(
            "slurm_fiber_clone_latency_seconds",
            "Time from a clone request's arrival to its started or miss reply.",
            buckets=buckets, sum_value=self._latency_sum)
        refusals = CounterMetricFamily("slurm_fiber_api_refusals",
                                       "Socket requests refused, by error code.", labels=["code"])
        for code, count in self._refusals.items():
            refusals.add_metric([code], count)
        yield refusals
        yield GaugeMetricFamily("slurm_fiber_fibers_running", "Fibers running now.",
                                value=float(self._running()))


class _Families:
    """The collector of a FiberMetrics' families (prometheus-client's Collector protocol)."""

    def __init__(self, metrics: FiberMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self.metrics.families()
