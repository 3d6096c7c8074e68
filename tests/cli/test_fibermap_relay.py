"""``fiberctl map --nodes all --via relay`` in a 2-node job on the real cluster, as a job user.

The job starts both nodes' fiberd as tests/cli/test_fibermap_nodes.py's jobs do, then runs
the map from the batch script on n1; the map reaches n2's fiberd through a relay srun runs
there (slurm_fiber/client/nodes/), hands tasks out as each node's slots free up, and writes the
output and joblog itself. The tasks coordinate through files in the work dir, never
through how long something takes; the waits are bounded and polled every 0.05 s.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.barehost.fiberjobkit import FIBERCTL, ended, wait_file
from tests.cli.test_fibermap_nodes import HALT, NODES, PRELUDE, PRINT, nothing_left

if TYPE_CHECKING:
    from tests.barehost.clusterkit import SlurmCluster
    from tests.security.userkit import JobUser

    WorkDir = Callable[[JobUser], Path]

pytestmark = pytest.mark.slurm

MAP = f"""{{before}}{FIBERCTL} map --nodes all --via relay -j{{jobs}} --joblog "joblog-$id" \\
  --results "res-$id" --json {{options}} -- sh -c {{command}} sh {{{{}}}} \\
  > "out-$id.tmp" 2> "err-$id"
echo "rc $?" >> "out-$id.tmp"
mv "out-$id.tmp" "out-$id"
"""
# Task 1 (on n1, the map's node, one slot each) ends well only once tasks 2..10 have all
# run: round robin would queue 3, 5, 7, 9 behind it on n1 and it would give up (60 s).
HELD = ("'if [ $1 = 1 ]; then i=0; until [ $(ls done-* 2>/dev/null | wc -l) -ge 9 ]; do "
        "i=$((i+1)); [ $i -lt 1200 ] || exit 3; sleep 0.05; done; else touch done-$1; fi; "
        "echo \"$1 $SLURMD_NODENAME\"'")
# Each task says where it started and runs until n2's fiberd was killed (or 60 s): the
# script kills it (SIGKILL) once two tasks run on n2.
STARTED = ("'touch started-$1-$SLURMD_NODENAME; i=0; until [ -e killed ] || [ $i -gt 1200 ]; "
           "do sleep 0.05; i=$((i+1)); done; echo \"$1 $SLURMD_NODENAME\"'")
KILL_N2 = f"""export SF
(i=0; until [ $(ls started-*-n2 2>/dev/null | wc -l) -ge 2 ] || [ $i -gt 1200 ]; do
  sleep 0.05; i=$((i+1)); done
 srun --overlap -N1 -n1 -w n2 sh -c \
   'kill -9 $({FIBERCTL} status --json | sed "s/.*\\"pid\\": \\([0-9]*\\).*/\\1/")'
 touch killed) &
"""


def run_map(cluster: SlurmCluster, user: JobUser, work: Path, options: str, command: str,
            jobs: int = 2, before: str = "",
            clean: bool = True) -> tuple[int, list[str], list[list[str]]]:
    """Submit the map job on both nodes; its id, stdout lines and joblog rows, once it
    ended (and, with ``clean``, left nothing behind on either node)."""
    script = PRELUDE.format(bin=cluster.site_bin, work=work) + MAP.format(
        options=options, command=command, jobs=jobs, before=before)
    job = cluster.submit(script, "-N2", "-t", "3", workdir=work, user=user)
    out = wait_file(work / f"out-{job}", timeout=180).splitlines()
    rows = [line.split("\t") for line in (work / f"joblog-{job}").read_text().splitlines()]
    assert ended(cluster, job) == "COMPLETED", (work / f"err-{job}").read_text()
    if clean:
        nothing_left(cluster, user, job)
    return job, out, rows


def test_relay_map_runs_tasks_on_both_nodes_fiberd_with_one_joblog(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    work = job_dir(job_user)
    job, out, rows = run_map(slurm_cluster, job_user, work, "--range 1-20", PRINT)
    assert out[-1] == "rc 1", (out, (work / f"err-{job}").read_text())  # one failed task
    summary = json.loads(out[-2])
    assert summary["tasks"] == 20 and summary["failed"] == 1 and summary["exit"] == 1
    ran = {int(line.split()[0]): line.split()[1] for line in out[:-2]}
    assert sorted(ran) == list(range(1, 21)), out
    assert set(ran.values()) == {"n1", "n2"}, out  # both nodes' fiberd ran tasks
    assert summary["nodes"] == {n: list(ran.values()).count(n) for n in NODES}
    assert summary["lost"] == {}
    assert rows[0] == ["Seq", "Host", "Starttime", "JobRuntime", "Send", "Receive", "Exitval",
                       "Signal", "Command"]
    assert len(rows) == 21 and sorted(int(r[0]) for r in rows[1:]) == list(range(1, 21))
    assert {int(r[0]): r[1] for r in rows[1:]} == ran  # Host: the node that ran it
    assert {int(r[0]): int(r[6]) for r in rows[1:] if r[6] != "0"} == {7: 3}
    # n2's tasks' output came back through the relay: printed, and kept by --results
    assert (work / f"res-{job}" / "1" / "7" / "stdout").read_text() == f"7 {ran[7]}\n"
    assert (work / f"res-{job}" / "1" / "8" / "seq").read_text() == "8\n"


def test_split_rr_over_the_relays_gives_each_node_every_other_task(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    work = job_dir(job_user)
    job, out, _rows = run_map(slurm_cluster, job_user, work, "--range 1-10 --split rr", PRINT)
    assert out[-1] == "rc 1", (out, (work / f"err-{job}").read_text())
    ran = {int(line.split()[0]): line.split()[1] for line in out[:-2]}
    assert ran == {n: "n1" if n % 2 else "n2" for n in range(1, 11)}, out


def test_a_node_held_by_a_long_task_gets_no_more_the_other_node_takes_the_rest(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    work = job_dir(job_user)
    job, out, rows = run_map(slurm_cluster, job_user, work, "--range 1-10", HELD, jobs=1)
    assert out[-1] == "rc 0", (out, (work / f"err-{job}").read_text())
    summary = json.loads(out[-2])
    assert summary["nodes"] == {"n1": 1, "n2": 9}, out
    ran = {int(line.split()[0]): line.split()[1] for line in out[:-2]}
    assert ran == {n: "n1" if n == 1 else "n2" for n in range(1, 11)}, out
    assert len(rows) == 11


def test_a_node_whose_fiberd_dies_mid_map_is_reported_and_its_tasks_run_elsewhere(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    work = job_dir(job_user)
    job, out, rows = run_map(slurm_cluster, job_user, work, "--range 1-12", STARTED,
                             before=KILL_N2, clean=False)
    err = (work / f"err-{job}").read_text()
    assert out[-1] == "rc 0", (out, err)
    assert "fiberctl map: node n2 lost (" in err, err
    summary = json.loads(out[-2])
    assert summary["tasks"] == 12 and summary["failed"] == 0
    assert set(summary["lost"]) == {"n2"}
    ran = {int(line.split()[0]): line.split()[1] for line in out[:-2]}
    assert sorted(ran) == list(range(1, 13)), out
    on_n2 = {int(p.name.split("-")[1]) for p in work.glob("started-*-n2")}
    assert len(on_n2) >= 2
    # The tasks n2 was running when its fiberd died ran again, to their end, on n1.
    assert all(ran[seq] == "n1" for seq in on_n2), (ran, on_n2)
    assert {int(r[0]): r[1] for r in rows[1:]} == ran
    assert len(rows) == 13


def test_halt_now_over_the_relays_stops_every_nodes_running_tasks(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    work = job_dir(job_user)
    job, out, rows = run_map(slurm_cluster, job_user, work,
                             "--range 1-20 --halt now,fail=1", HALT)
    assert out[-1] == "rc 3", (out, (work / f"err-{job}").read_text())  # the failing task's
    summary = json.loads(out[-2])
    assert summary["halted"] is True and summary["exit"] == 3
    by_seq = {int(r[0]): r for r in rows[1:]}
    assert by_seq[1][6] == "3"
    assert by_seq[2][7] != "0", rows  # task 2 (which made task 1 fail) was stopped
    assert {r[1] for r in rows[1:]} == {"n1", "n2"}, rows  # sleepers on both nodes
    assert all(r[6] != "0" for r in rows[1:]), rows  # no sleeper was let finish
    assert len(rows) - 1 < 20  # no task was started after the halt but those running


def test_via_relay_without_nodes_all_is_refused(tmp_path: Path) -> None:
    import subprocess
    import sys

    fiberctl = str(Path(sys.executable).parent / "fiberctl")
    out = subprocess.run([fiberctl, "map", "--via", "relay", "echo", ":::", "a"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.startswith("fiberctl map: --via relay takes effect with --nodes all"), out
