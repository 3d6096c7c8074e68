"""Every job's fiberd on a Slurm node through the node's node_exporter (issue 40, item 3):
``slurm-fiber node-metrics`` relays each job's metrics, asked as the job's user, into
root's textfile dir; node_exporter (Debian's, textfile collector on a glob) serves them and
Prometheus answers a query by job; the epilog removes the job's file. A job user cannot
stall the node's exporter nor label samples as another job's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_fiber.homes.slurm.nodemetrics import (
    job_textfile_name,
    metrics_dir,
    relabel,
    relay_node,
)
from tests.barehost.fiberjobkit import FIBERCTL, job_script, settle, wait_file
from tests.release.promkit import node_exporter, prometheus, query_until

if TYPE_CHECKING:
    from tests.barehost.clusterkit import SlurmCluster
    from tests.security.userkit import JobUser

    WorkDir = Callable[[JobUser], Path]

FORGED = """# TYPE slurm_fiber_api_refusals counter
# TYPE slurm_fiber_fibers_running gauge
slurm_fiber_fibers_running{job_id="999",node="other",home="k"} 5
# TYPE node_load1 gauge
node_load1 42
"""


def test_relabel_keeps_only_slurm_fiber_samples_labelled_with_the_relays_job_and_node() -> None:
    text = relabel(FORGED, 7, "n1")
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert [(s.name, s.labels, s.value) for s in samples] == [
        ("slurm_fiber_fibers_running", {"job_id": "7", "node": "n1", "home": "slurm"}, 5.0)]
    with pytest.raises(ValueError):
        relabel("this is { not prometheus", 7, "n1")


# The job: its fiberd with a fiber running, then (hostile) a FIFO and a forged .prom file in
# its own state dir, and a token of its socket; held until the test releases it.
RELAYED = f"""{FIBERCTL} run -- sleep 300 &
until {FIBERCTL} ls --json 2>/dev/null | grep -q '"running"'; do sleep 0.1; done
state="{{state}}/nodes/$SLURMD_NODENAME/jobs/$id"
mkfifo "$state/evil.prom" && echo 'slurm_fiber_fibers_running{{job_id="1"}} 9' > "$state/x.prom"
echo "$state" > "state-$id.tmp"; mv "state-$id.tmp" "state-$id"
"""


@pytest.mark.slurm
@pytest.mark.hostile
def test_each_jobs_fiberd_reaches_prometheus_through_node_exporter_and_the_epilog_cleans_up(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir,
        tmp_path: Path) -> None:
    work = job_dir(job_user)
    root = _state_root(slurm_cluster)
    body = RELAYED.replace("{state}", str(root))
    job = slurm_cluster.submit(job_script(slurm_cluster, work, body, hold=True), "-w", "n1",
                               "-t", "3", workdir=work, user=job_user)
    wait_file(work / f"state-{job}", timeout=120)
    done = relay_node(root, "n1", timeout=5)
    assert job in done.up, done
    textfile = metrics_dir(root, "n1") / job_textfile_name(job)
    st = textfile.stat()
    assert (st.st_uid, oct(st.st_mode & 0o777)) == (0, oct(0o644))
    with node_exporter(tmp_path, f"{root}/nodes/*/metrics") as exporter, \
            prometheus(tmp_path, [exporter]) as base:
        (running,) = query_until(base, f'slurm_fiber_fibers_running{{job_id="{job}"}}')
        assert running["metric"]["node"] == "n1"  # type: ignore[index]
        assert running["value"][1] == "1"  # type: ignore[index]
        (up,) = query_until(base, f'slurm_fiber_relay_job_up{{job_id="{job}"}}')
        assert up["value"][1] == "1"  # type: ignore[index]
        errors = query_until(base, "node_textfile_scrape_error")
        assert errors[0]["value"][1] == "0"  # type: ignore[index]
        forged = query_until(base, "count(slurm_fiber_fibers_running)")
        assert forged[0]["value"][1] == "1"  # type: ignore[index]  # the job's, not job 1's
    (work / f"release-{job}").write_text("")
    settle(lambda: [] if not textfile.exists() else [f"{textfile} still there"],
           "the epilog did not remove the job's metrics file")
    again = relay_node(root, "n1", timeout=5)
    assert job not in again.up and not textfile.exists()


def _state_root(cluster: SlurmCluster) -> Path:
    from slurm_fiber.homes.slurm.siteconfig import load_site_config

    assert cluster.site_config is not None
    return load_site_config({"SLURM_FIBER_CONFIG": str(cluster.site_config)}).state_root


def test_node_metrics_command_makes_the_dir_and_removes_stale_files(tmp_path: Path) -> None:
    root = tmp_path / "state"
    (root / "nodes" / "n9" / "jobs").mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    stale = metrics_dir(root, "n9")
    stale.mkdir()
    (stale / job_textfile_name(41)).write_text("slurm_fiber_fibers_running 1\n")
    done = subprocess.run([str(Path(sys.executable).parent / "slurm-fiber"), "node-metrics",
                           "--state-root", str(root), "--every", "0", "-v"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(stale)) == ["slurm_fiber_relay.prom"]
    assert "node n9: up [], down [], removed ['slurm_fiber_job_41.prom']" in done.stderr


SILENT_SERVER = """
import os, socket, sys, time
sock = socket.socket(socket.AF_UNIX)
sock.bind("fiberd.sock")
sock.listen(8)
open("listening", "w").close()
conns = []
while True:  # accepts, reads, never answers
    conn, _ = sock.accept()
    conns.append(conn)
"""


@pytest.mark.hostile
def test_a_jobs_silent_fiberd_costs_the_relay_its_timeout_and_is_reported_down() -> None:
    """A job user's fiberd (here: a socket that accepts and never answers, run as nobody)
    cannot hold the node's relay: the child asking it is killed after the timeout, the job
    is reported down, and no file of it is written."""
    import pwd
    import shutil
    import tempfile

    nobody = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="sf-relay-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        jobs = base / "nodes" / "n9" / "jobs"
        jobs.mkdir(parents=True)
        job = jobs / "77"
        job.mkdir(mode=0o700)
        os.chown(job, nobody.pw_uid, nobody.pw_gid)
        server = subprocess.Popen(["/usr/bin/python3", "-c", SILENT_SERVER], cwd=job,
                                  user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[])
        try:
            settle(lambda: [] if (job / "listening").exists() else ["not listening"],
                   "the silent server did not start", 30)
            done = relay_node(base, "n9", timeout=1.0)
        finally:
            server.kill()
            server.wait(10)
        assert done.up == () and done.down == (77,)
        written = sorted(os.listdir(metrics_dir(base, "n9")))
        assert written == ["slurm_fiber_relay.prom"]
        relay = (metrics_dir(base, "n9") / "slurm_fiber_relay.prom").read_text()
        assert 'slurm_fiber_relay_job_up{job_id="77",node="n9"} 0' in relay
    finally:
        shutil.rmtree(base)
