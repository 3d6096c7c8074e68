"""fiberd's metrics as Prometheus and node_exporter read them: a real fiberd, a real HTTP GET,
the textfile parsed by prometheus-client's parser, and the labels where fiberd runs."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_fiber import __version__
from slurm_fiber.client.connection import FiberdClient
from slurm_fiber.core.clock import FakeClock, SystemClock
from slurm_fiber.core.fibers.fiber import FiberEnd, FiberState, StopReason
from slurm_fiber.core.metrics.export import (
    ACCEPT_BURST,
    ACCEPT_RATE,
    REFRESH,
    Labelled,
    scope_labels,
    start_export,
    textfile_name,
)
from slurm_fiber.core.metrics.families import (
    END_REASONS,
    MAX_GRANTS,
    OTHER_GRANT,
    RENDER_INTERVAL,
    FiberMetrics,
    end_reason,
)
from slurm_fiber.core.trust.grant import ScopeClaim
from slurm_fiber.homes.slurm.home import job_scope
from slurm_fiber.homes.slurm.jobenv import SlurmJob
from tests.cli.commandkit import (
    BIN,
    env,
    fiberd,
    flags,
    start_long_fiber,
    wait_ready,
    wait_socket,
)
from tests.core.processkit import aio
from tests.core.runtime.fiberdkit import Site, until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples]
            for f in text_string_to_metric_families(text)}


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""


def scrape_until(port: int, name: str, labels: dict[str, str],
                 value: float) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """The scrape that first shows sample ``name{labels} value`` (an exposition is served
    again for up to RENDER_INTERVAL before it is rebuilt); fails after 15 s."""
    end = time.monotonic() + 15
    while True:
        status, text = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        scraped = families(text)
        if any((n, lab, v) == (name, labels, value) for samples in scraped.values()
               for n, lab, v in samples):
            return scraped
        assert time.monotonic() < end, f"{name}{labels} {value} never scraped:\n{text}"
        time.sleep(0.2)


def test_http_and_textfile_expose_the_same_labelled_metrics_and_the_file_goes_on_stop(
        site: Site) -> None:
    site.drop()
    port = free_port()
    textdir = site.state.parent / "textfile"
    textdir.mkdir(mode=0o700)
    options: dict[str, str | None] = {"metrics-listen": f"127.0.0.1:{port}",
                                      "metrics-textfile": str(textdir)}
    with fiberd(site, options, stderr=subprocess.PIPE) as proc:
        sock = wait_socket(site, proc)
        wait_ready(sock)
        start_long_fiber(sock)
        scraped = scrape_until(port, "slurm_fiber_clones_total",
                               {"home": "standalone", "grant": "g1"}, 1.0)
        assert ("slurm_fiber_fiber_ends_total", {"home": "standalone", "grant": "g1",
                                                 "reason": "ok"}, 0.0) in \
            scraped["slurm_fiber_fiber_ends"]
        assert scraped["slurm_fiber_fibers_running"] == \
            [("slurm_fiber_fibers_running", {"home": "standalone"}, 1.0)]
        assert all(labels.get("home") == "standalone"
                   for samples in scraped.values() for _, labels, _ in samples)
        assert get(f"http://127.0.0.1:{port}/other")[0] == 404
        written = textdir / "slurm_fiber.prom"
        assert oct(written.stat().st_mode & 0o777) == oct(0o644)
        filed = families(written.read_text())
        assert filed.keys() == scraped.keys()
        assert filed["slurm_fiber_fibers_running"][0][1] == {"home": "standalone"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()  # type: ignore[union-attr]
    assert list(textdir.iterdir()) == []


@pytest.mark.parametrize("value", ["127.0.0.1:99999", ":9464", "127.0.0.1:", "::1:9464",
                                   "no host!:80", "[nope]:80"])
def test_a_bad_metrics_listen_value_is_refused_in_one_line(site: Site, value: str) -> None:
    out = subprocess.run([str(BIN / "fiberd"), *flags(site), f"--metrics-listen={value}"],
                         env=env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("fiberd: metrics_listen (from --metrics-listen): ")


def test_a_metrics_port_in_use_refuses_the_start_in_one_line(site: Site) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([str(BIN / "fiberd"), *flags(site),
                              f"--metrics-listen=127.0.0.1:{port}"],
                             env=env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1, out.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr
    assert not (site.state / "fiberd.sock").exists()


def test_an_unsafe_textfile_dir_refuses_the_start_in_one_line(site: Site, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could plant or replace files here
    out = subprocess.run([str(BIN / "fiberd"), *flags(site), f"--metrics-textfile={shared}"],
                         env=env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1, out.stderr
    assert f"unsafe metrics textfile dir {shared}" in out.stderr


def test_on_slurm_the_labels_are_the_home_job_and_node() -> None:
    job = SlurmJob(job_id=42, uid=1000, gid=1000, user="alice", partition="p", node="n1",
                   cluster="c")
    labels = scope_labels("slurm", job_scope(job))
    assert labels == {"home": "slurm", "job_id": "42", "node": "n1"}
    assert textfile_name(labels) == "slurm_fiber_job_42.prom"
    text = Labelled(FiberMetrics(lambda: 3), lambda: labels).render().decode()
    assert families(text)["slurm_fiber_fibers_running"] == \
        [("slurm_fiber_fibers_running", labels, 3.0)]
    assert scope_labels("standalone", []) == {"home": "standalone"}
    assert scope_labels("kubernetes", [ScopeClaim("kubernetes.node", "w1")]) == \
        {"home": "kubernetes", "node": "w1"}


async def http_get(port: int, head: bytes = b"GET /metrics HTTP/1.0\r\n\r\n") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    reply = await reader.read()
    writer.close()
    return reply


@aio
async def test_the_textfile_is_refreshed_on_the_clock_and_a_stalling_client_delays_no_scrape(
        tmp_path: Path, clock: FakeClock) -> None:
    running = [0]
    port = free_port()
    export = await start_export(FiberMetrics(lambda: running[0]), lambda: {"home": "h"}, clock,
                                listen=("127.0.0.1", port), textfile=str(tmp_path))
    try:
        prom = tmp_path / "slurm_fiber.prom"
        assert ("slurm_fiber_fibers_running", {"home": "h"}, 0.0) in \
            families(prom.read_text())["slurm_fiber_fibers_running"]
        running[0] = 2
        await until(lambda: clock.sleepers == 1)  # the refresh waits on the clock
        clock.advance(REFRESH - 0.001)
        await clock.settle()
        assert "fibers_running{home=\"h\"} 0.0" in prom.read_text()  # not yet due
        clock.advance(0.001)
        await until(lambda: "slurm_fiber_fibers_running{home=\"h\"} 2.0" in prom.read_text())
        # a client that sends half a head and waits, and one that sends too much
        _, stalled = await asyncio.open_connection("127.0.0.1", port)
        stalled.write(b"GET /metr")
        assert await http_get(port, b"GET /metrics HTTP/1.0\r\nX: " + b"x" * 10000) == b""
        reply = await http_get(port)
        assert reply.startswith(b"HTTP/1.0 200 OK\r\n")
        assert b'slurm_fiber_fibers_running{home="h"} 2.0' in reply
        assert (await http_get(port, b"POST /metrics HTTP/1.0\r\n\r\n")).startswith(
            b"HTTP/1.0 405")
        stalled.close()
    finally:
        await export.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError):
        await http_get(port)


def test_fiberd_without_a_scrape_never_imports_prometheus() -> None:
    code = (
        "import sys\n"
        "import slurm_fiber.daemon\n"
        "from slurm_fiber.core.metrics.families import FiberMetrics\n"
        "from slurm_fiber.core.book.misses import MissCode\n"
        "m = FiberMetrics(lambda: 2)\n"
        "m.clone_started(0.004); m.clone_missed(MissCode.COLD, 0.3); m.refused('bad_request')\n"
        "assert 'prometheus_client' not in sys.modules, 'imported before a scrape'\n"
        "text = m.render()\n"
        "assert 'prometheus_client' in sys.modules\n"
        "print(text)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    samples = {(s.name, s.labels.get("code"), s.labels.get("le")): s.value
               for f in text_string_to_metric_families(out) for s in f.samples}
    assert samples[("slurm_fiber_clones_total", None, None)] == 1
    assert samples[("slurm_fiber_clone_misses_total", "cold", None)] == 1
    assert samples[("slurm_fiber_clone_misses_total", "denied", None)] == 0
    assert samples[("slurm_fiber_api_refusals_total", "bad_request", None)] == 1
    assert samples[("slurm_fiber_clone_latency_seconds_bucket", None, "0.005")] == 1
    assert samples[("slurm_fiber_clone_latency_seconds_bucket", None, "+Inf")] == 2
    assert samples[("slurm_fiber_fibers_running", None, None)] == 2


def test_fiber_ends_are_counted_per_grant_and_reason_with_build_info(site: Site) -> None:
    site.drop()
    port = free_port()
    with fiberd(site, {"metrics-listen": f"127.0.0.1:{port}"}, stderr=subprocess.PIPE) as proc:
        sock = wait_socket(site, proc)
        wait_ready(sock)
        with FiberdClient(sock) as client:
            for argv in (["true"], ["false"]):
                client.clone(grant="g1", exec={"argv": argv}, wait=True)
                client.wait_exit()
        with FiberdClient(sock) as client:
            fiber = client.clone(grant="g1", exec={"argv": ["sleep", "60"]})
            client.request("stop_fiber", fiber=fiber["id"], grace=1)
        scraped = scrape_until(port, "slurm_fiber_fiber_ends_total",
                               {"home": "standalone", "grant": "g1", "reason": "killed"}, 1.0)
        ends = {s[1]["reason"]: s[2] for s in scraped["slurm_fiber_fiber_ends"]}
        assert ends == {"ok": 1.0, "failed": 1.0, "deadline": 0.0, "oom": 0.0,
                        "killed": 1.0, "lost": 0.0}
        assert ("slurm_fiber_clones_total", {"home": "standalone", "grant": "g1"}, 3.0) in \
            scraped["slurm_fiber_clones"]
        (info,) = scraped["slurm_fiber_build_info"]
        assert info[2] == 1.0 and info[1]["version"] == __version__
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def end(state: FiberState = FiberState.EXITED, status: int | None = 0,
        reason: str | None = None, result: dict[str, object] | None = None) -> FiberEnd:
    return FiberEnd(state=state, status=status, result=result,
                    reason=StopReason(reason, "why") if reason else None)


@pytest.mark.parametrize(("fiber_end", "mode", "expected"), [
    (end(), "exec", "ok"),
    (end(result={"ok": True, "result": 1}), "call", "ok"),
    (end(status=1 << 8), "exec", "failed"),
    (end(result={"ok": False, "error": {"type": "ValueError"}}), "call", "failed"),
    (end(result=None), "call", "failed"),  # died before reporting a result
    (end(status=127 << 8, result={"exec_failed": {"errno": 2}}), "exec", "failed"),
    (end(status=9, reason="deadline"), "exec", "deadline"),
    (end(status=15, reason="lease_end"), "exec", "deadline"),
    (end(status=9, reason="oom"), "exec", "oom"),
    (end(status=15, reason="stopped"), "exec", "killed"),
    (end(status=15, reason="removed"), "exec", "killed"),
    (end(status=9, reason="signal"), "exec", "killed"),
    (end(state=FiberState.LOST, status=None), "exec", "lost"),
    (end(status=9, reason="template_lost"), "call", "lost"),
    (None, "exec", "lost"),
])
def test_end_reason_names_each_way_a_fiber_ends(fiber_end: FiberEnd | None, mode: str,
                                                expected: str) -> None:
    assert end_reason(fiber_end, mode) == expected
    assert expected in END_REASONS


def test_grant_labels_are_bounded() -> None:
    metrics = FiberMetrics()
    for n in range(MAX_GRANTS + 50):
        metrics.clone_started(0.001, f"g{n}")
    text = metrics.render()
    grants = {s.labels["grant"] for f in text_string_to_metric_families(text)
              if f.name == "slurm_fiber_clones" for s in f.samples}
    assert len(grants) == MAX_GRANTS + 1 and OTHER_GRANT in grants


def scrape_loop(port: int, until: float, answered: list[int]) -> None:
    """GET /metrics as fast as one client can until ``until`` (monotonic)."""
    while time.monotonic() < until:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                if conn.recv(16).startswith(b"HTTP/1.0 200"):
                    answered.append(1)
        except OSError:
            pass


@aio
async def test_a_local_scrape_loop_gets_a_bounded_number_of_renders_and_answers(
        tmp_path: Path) -> None:
    """Issue 38 (low): a local scrape loop cost fiberd ~70% of a CPU. However fast clients
    loop, fiberd builds about one exposition a second and answers about ACCEPT_RATE
    requests a second (the rest wait in the kernel's backlog)."""
    rendered: list[float] = []

    def labels() -> dict[str, str]:  # called once per exposition fiberd builds
        rendered.append(time.monotonic())
        return {"home": "h"}

    port = free_port()
    export = await start_export(FiberMetrics(), labels, SystemClock(),
                                listen=("127.0.0.1", port), textfile=None)
    seconds, clients = 3.0, 4
    answered: list[int] = []
    try:
        start = time.monotonic()
        await asyncio.gather(*(asyncio.to_thread(scrape_loop, port, start + seconds, answered)
                               for _ in range(clients)))
        took = time.monotonic() - start
    finally:
        await export.close()
    assert answered, "no scrape was answered at all"
    assert len(rendered) <= took / RENDER_INTERVAL + 2, len(rendered)
    assert len(answered) <= ACCEPT_RATE * took + ACCEPT_BURST + 2, len(answered)
