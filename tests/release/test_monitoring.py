"""Monitoring a site can plug in (issue 40, item 3): Debian's Prometheus scrapes a live fiberd
and answers a query about it, with the shipped alert rules loaded and checked by promtool;
the Grafana dashboard and the rules name only metrics fiberd (or the node relay) exports,
with labels they carry."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from slurm_fiber import __version__
from slurm_fiber.client.connection import FiberdClient
from slurm_fiber.core.book.misses import MissCode
from slurm_fiber.core.metrics.export import Labelled
from slurm_fiber.core.metrics.families import FiberMetrics
from slurm_fiber.homes.slurm.nodemetrics import _relay_text
from tests.cli.commandkit import fiberd, start_long_fiber, wait_ready, wait_socket
from tests.core.runtime.fiberdkit import Site
from tests.release.promkit import PROMTOOL, free_port, get_json, need, prometheus, query_until

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "contrib" / "prometheus" / "slurm-fiber-alerts.yml"
DASHBOARD = REPO / "contrib" / "grafana" / "slurm-fiber-dashboard.json"
# Labels Prometheus adds, and Grafana's own variables.
PROMETHEUS_LABELS = {"instance", "job", "le"}


def test_promtool_checks_the_alert_rules() -> None:
    done = subprocess.run([need(PROMTOOL), "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout


def test_prometheus_scrapes_a_live_fiberd_and_answers_a_query(site: Site, tmp_path: Path) -> None:
    site.drop()
    port = free_port()
    with fiberd(site, {"metrics-listen": f"127.0.0.1:{port}"}, stderr=subprocess.PIPE) as proc:
        sock = wait_socket(site, proc)
        wait_ready(sock)
        start_long_fiber(sock)
        with prometheus(tmp_path, [f"127.0.0.1:{port}"], rules=RULES) as base:
            (clones,) = query_until(base, 'slurm_fiber_clones_total{grant="g1"}')
            assert clones["value"][1] == "1"  # type: ignore[index]
            assert clones["metric"]["home"] == "standalone"  # type: ignore[index]
            (info,) = query_until(base, "slurm_fiber_build_info")
            assert info["metric"]["version"] == __version__  # type: ignore[index]
            (running,) = query_until(base, "sum(slurm_fiber_fibers_running)")
            assert running["value"][1] == "1"  # type: ignore[index]
            groups = get_json(f"{base}/api/v1/rules")["data"]["groups"]  # type: ignore[index]
            rules = [rule for group in groups for rule in group["rules"]]
            assert len(rules) == 7 and all(rule["health"] == "ok" for rule in rules), rules
        with FiberdClient(sock) as client:
            for fiber in client.request("list_fibers")["fibers"]:  # type: ignore[union-attr]
                client.request("stop_fiber", fiber=fiber["id"], grace=1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def exported() -> tuple[set[str], set[str]]:
    """The sample names and label names a fiberd on Slurm and the node relay export."""
    metrics = FiberMetrics(lambda: 1)
    metrics.clone_started(0.003, "g1")
    metrics.clone_missed(MissCode.COLD, 0.2)
    metrics.refused("bad_request")
    metrics.fiber_ended("g1", None, "exec")
    labels = {"home": "slurm", "job_id": "7", "node": "n1"}
    text = Labelled(metrics, lambda: labels).render().decode() + _relay_text("n1", [7], [8])
    names, label_names = set(), set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.add(sample.name)
            label_names |= set(sample.labels)
    return names, label_names


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """The slurm_fiber metric names and the label names an expression uses."""
    names = set(re.findall(r"\bslurm_fiber_\w+", expr))
    labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    return names, labels


def test_dashboard_and_rules_use_only_exported_metrics_and_labels() -> None:
    names, labels = exported()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [var["query"]["query"] for var in dashboard["templating"]["list"]
              if isinstance(var.get("query"), dict)]
    exprs += [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"]
              for rule in group["rules"]]
    assert len(exprs) > 15
    for expr in exprs:
        used, used_labels = promql_names(expr)
        assert used, f"no slurm_fiber metric in {expr!r}"
        assert used <= names, f"{expr!r} names {used - names}, not exported"
        assert used_labels <= labels | PROMETHEUS_LABELS, \
            f"{expr!r} uses labels {used_labels - labels - PROMETHEUS_LABELS}"
