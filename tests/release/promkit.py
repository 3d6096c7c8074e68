"""Debian's Prometheus and node_exporter, run for a test: started on free ports with their
data in a tmp dir, asked over their HTTP API, stopped at the end. The tests that use them
fail (not skip) when the packages are missing: .ci/run installs them (apt-get install
prometheus prometheus-node-exporter)."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def need(path: str) -> str:
    assert shutil.which(path), (f"{path} is missing: apt-get install prometheus "
                                "prometheus-node-exporter (./dev test does)")
    return path


def get_json(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return dict(json.load(reply))


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"{url}'s server exited: {log.read_text()[-2000:]}"
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=2).close()
            return
        assert time.monotonic() < deadline, f"{url} never answered: {log.read_text()[-2000:]}"
        time.sleep(0.1)


@contextlib.contextmanager
def running(argv: list[str], ready_url: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(ready_url, proc, log)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@contextlib.contextmanager
def prometheus(tmp: Path, targets: list[str], rules: Path | None = None) -> Iterator[str]:
    """A Prometheus scraping ``targets`` (host:port) every second; yields its base URL."""
    port = free_port()
    config = tmp / "prometheus.yml"
    rule_files = f"rule_files: [{json.dumps(str(rules))}]\n" if rules else ""
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n" + rule_files +
        "scrape_configs:\n- job_name: slurm_fiber\n  static_configs:\n"
        f"  - targets: {json.dumps(targets)}\n")
    base = f"http://127.0.0.1:{port}"
    argv = [need(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}"]
    with running(argv, f"{base}/-/ready", tmp / "prometheus.log"):
        yield base


@contextlib.contextmanager
def node_exporter(tmp: Path, textfile_dir: str) -> Iterator[str]:
    """node_exporter with only its textfile collector, reading ``textfile_dir`` (a glob may
    name several dirs); yields its host:port."""
    port = free_port()
    argv = [need(NODE_EXPORTER), f"--web.listen-address=127.0.0.1:{port}",
            "--collector.disable-defaults", "--collector.textfile",
            f"--collector.textfile.directory={textfile_dir}"]
    with running(argv, f"http://127.0.0.1:{port}/metrics", tmp / "node_exporter.log"):
        yield f"127.0.0.1:{port}"


def query(base: str, promql: str) -> list[dict[str, object]]:
    """The instant query's result vector."""
    reply = get_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    assert reply["status"] == "success", reply
    data = reply["data"]
    assert isinstance(data, dict)
    return list(data["result"])


def query_until(base: str, promql: str, timeout: float = 60) -> list[dict[str, object]]:
    """The first non-empty answer to ``promql`` (Prometheus scrapes every second)."""
    deadline = time.monotonic() + timeout
    while True:
        found = query(base, promql)
        if found:
            return found
        assert time.monotonic() < deadline, f"no answer to {promql} in {timeout} s"
        time.sleep(0.5)
