"""Prometheus metrics for fiberd, in a registry of their own, built only when asked.

``FiberMetrics`` tallies clone outcomes, latencies and refusals in plain
counters (recording imports nothing and costs a dict update); prometheus-client
is imported the first time the metrics are read (``registry``, ``render``: the
``metrics`` op, ``--metrics-listen``, ``--metrics-textfile``), so a fiberd
nobody scrapes never loads it. The registry is private, so two daemons (or
many tests) in one process never collide and nothing leaks into
prometheus-client's global registry; its one collector builds the families
from the tallies at each scrape, and the number of running fibers is read from
the runtime then. ``render()`` gives the text exposition format served by the
``metrics`` op; ``core.metrics_export`` exposes the same registry, labelled
with where fiberd runs, over HTTP and as a node_exporter textfile.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from slurm_fiber.core.misses import MissCode

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

# Clone round trips are milliseconds; the tail reaches seconds when a template is large.
CLONE_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # prometheus-client's, unimported


class FiberMetrics:
    """The daemon's metrics. Recording methods never block and never raise for valid input.

    ``running`` is called at each scrape to read how many fibers run now.
    """

    def __init__(self, running: Callable[[], int] = lambda: 0) -> None:
        self._running = running
        self._clones = 0
        self._misses: Counter[str] = Counter({code.value: 0 for code in MissCode})
        self._refusals: Counter[str] = Counter()
        self._buckets = [0] * (len(CLONE_LATENCY_BUCKETS) + 1)  # per bucket, +Inf last
        self._latency_sum = 0.0
        self._registry: CollectorRegistry | None = None

    def clone_started(self, seconds: float) -> None:
        """Record a clone that started a fiber after ``seconds``."""
        self._clones += 1
        self._observe(seconds)

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
        """The Prometheus text exposition of every metric."""
        from prometheus_client.exposition import generate_latest

        return generate_latest(self.registry).decode()

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

        yield CounterMetricFamily("slurm_fiber_clones", "Clones that started a fiber.",
                                  value=self._clones)
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
