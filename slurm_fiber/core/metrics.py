"""Prometheus metrics for fiberd, in a registry of their own.

``FiberMetrics`` keeps its collectors in a private CollectorRegistry, so two
daemons (or many tests) in one process never collide and nothing leaks into
prometheus-client's global registry. The socket server records clone
outcomes and latencies and refusals; the number of running fibers is read
from the runtime at each scrape. ``render()`` gives the text exposition
format served by the ``metrics`` op; ``core.metrics_export`` exposes the same
registry, labelled with where fiberd runs, over HTTP and as a node_exporter textfile.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from slurm_fiber.core.misses import MissCode

# Clone round trips are milliseconds; the tail reaches seconds when a template is large.
CLONE_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class FiberMetrics:
    """The daemon's metrics. Methods never block and never raise for valid input.

    ``running`` is called at each scrape to read how many fibers run now.
    """

    def __init__(self, running: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.clones = Counter(
            "slurm_fiber_clones", "Clones that started a fiber.", registry=self.registry)
        self.misses = Counter(
            "slurm_fiber_clone_misses", "Clones that started nothing, by miss code.",
            ["code"], registry=self.registry)
        self.latency = Histogram(
            "slurm_fiber_clone_latency_seconds",
            "Time from a clone request's arrival to its started or miss reply.",
            buckets=CLONE_LATENCY_BUCKETS, registry=self.registry)
        self.refusals = Counter(
            "slurm_fiber_api_refusals", "Socket requests refused, by error code.",
            ["code"], registry=self.registry)
        self.running = Gauge(
            "slurm_fiber_fibers_running", "Fibers running now.", registry=self.registry)
        self.running.set_function(lambda: float(running()))
        for code in MissCode:  # every code shows from the first scrape, at 0
            self.misses.labels(code=code.value)

    def clone_started(self, seconds: float) -> None:
        """Record a clone that started a fiber after ``seconds``."""
        self.clones.inc()
        self.latency.observe(seconds)

    def clone_missed(self, code: MissCode, seconds: float) -> None:
        """Record a clone that missed with ``code`` after ``seconds``."""
        self.misses.labels(code=code.value).inc()
        self.latency.observe(seconds)

    def refused(self, code: str) -> None:
        """Record a refused request (an error reply) with its error code."""
        self.refusals.labels(code=code).inc()

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode()
