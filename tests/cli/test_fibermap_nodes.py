"""``fiberctl map --nodes all`` in a 2-node job on the real cluster, run as a job user.

The job starts one fiberd per node with one `srun --overlap --ntasks-per-node=1
fiberd-run` step (as docs/slurm.md tells job authors), waits with one
`fiberctl wait` step on both nodes, then runs the map from the batch script; the
test reads what the job wrote in its work dir: the map's stdout, merged joblog,
results and exit status. Afterwards nothing of the job may remain on either
node. The waits are for the cluster to act, polled every 0.1 s.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurm_fiber.homes.slurm.siteconfig import load_site_config
from tests.barehost.fiberjobkit import FIBERCTL, READY_S, ended, leftovers, settle, wait_file

if TYPE_CHECKING:
    from tests.barehost.clusterkit import SlurmCluster
    from tests.security.userkit import JobUser

    WorkDir = Callable[[JobUser], Path]

pytestmark = pytest.mark.slurm
NODES = ("n1", "n2")

# Both nodes' fiberd, started and ready, then the body; its output written whole.
PRELUDE = f"""#!/bin/sh
SF="{{bin}}"
cd "{{work}}"
id=$SLURM_JOB_ID
srun --overlap --ntasks-per-node=1 -N2 "$SF/fiberd-run" > "fiberd-$id.log" 2>&1 &
if ! srun --overlap --ntasks-per-node=1 -N2 {FIBERCTL} wait --timeout {READY_S} \\
    > "wait-$id.log" 2>&1; then
  echo "fiberd not ready on both nodes" > "failed-$id"; exit 1
fi
"""
MAP = f"""{FIBERCTL} map --nodes all -j2 --joblog "joblog-$id" --results "res-$id" --json \\
  {{options}} -- sh -c {{command}} sh {{{{}}}} > "out-$id.tmp" 2> "err-$id"
echo "rc $?" >> "out-$id.tmp"
mv "out-$id.tmp" "out-$id"
"""
# Task 7 fails with status 3; each prints its argument and the node it ran on.
PRINT = """'echo "$1 $SLURMD_NODENAME"; [ "$1" != 7 ] || exit 3'"""
# Task 1 (node 1's share) fails once task 2 (node 2's) runs; every other task sleeps long.
HALT = ("'case $1 in 1) i=0; until [ -e started-2 ] || [ $i -gt 600 ]; do sleep 0.05; "
        "i=$((i+1)); done; exit 3;; *) touch started-$1; exec sleep 120;; esac'")


def map_job(cluster: SlurmCluster, work: Path, options: str, command: str) -> str:
    return PRELUDE.format(bin=cluster.site_bin, work=work) + MAP.format(options=options,
                                                                       command=command)


def run_map(cluster: SlurmCluster, user: JobUser, work: Path, options: str,
            command: str) -> tuple[int, list[str], list[list[str]]]:
    """Submit the map job on both nodes; its id, stdout lines and joblog rows, once it
    ended and left nothing behind on either node."""
    job = cluster.submit(map_job(cluster, work, options, command), "-N2", "-t", "3",
                         workdir=work, user=user)
    out = wait_file(work / f"out-{job}", timeout=180).splitlines()
    rows = [line.split("\t") for line in (work / f"joblog-{job}").read_text().splitlines()]
    assert ended(cluster, job) == "COMPLETED", (work / f"err-{job}").read_text()
    nothing_left(cluster, user, job)
    assert not list(work.glob(".fibermap-*")), "the map's spool dir was left behind"
    return job, out, rows


def nothing_left(cluster: SlurmCluster, user: JobUser, job: int) -> None:
    """Wait (bounded) until nothing of the ended job remains on either node."""
    assert cluster.site_config is not None
    site = load_site_config({"SLURM_FIBER_CONFIG": str(cluster.site_config)})
    for node in NODES:
        settle(lambda node=node: leftovers(site, cluster.env["SLURM_CONF"], "citest",  # type: ignore[misc]
                                           node, job, (), user.uid),
               f"job {job} left something behind on {node}")


def test_map_nodes_all_runs_each_nodes_share_on_its_fiberd_with_one_joblog(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    work = job_dir(job_user)
    job, out, rows = run_map(slurm_cluster, job_user, work, "--range 1-20 --split rr", PRINT)
    assert out[-1] == "rc 1", (out, (work / f"err-{job}").read_text())  # one failed task
    summary = json.loads(out[-2])
    assert summary["tasks"] == 20 and summary["failed"] == 1 and summary["exit"] == 1
    assert summary["nodes"] == {"n1": 10, "n2": 10}
    ran = {int(line.split()[0]): line.split()[1] for line in out[:-2]}
    # Round robin by sequence number: odd ones on n1, even ones on n2, each via its fiberd.
    assert ran == {n: "n1" if n % 2 else "n2" for n in range(1, 21)}, out
    assert rows[0] == ["Seq", "Host", "Starttime", "JobRuntime", "Send", "Receive", "Exitval",
                       "Signal", "Command"]
    assert len(rows) == 21 and sorted(int(r[0]) for r in rows[1:]) == list(range(1, 21))
    assert {int(r[0]): r[1] for r in rows[1:]} == ran  # Host: the node that ran it
    assert {int(r[0]): int(r[6]) for r in rows[1:] if r[6] != "0"} == {7: 3}
    ends = [float(r[2]) + float(r[3]) for r in rows[1:]]
    assert ends == sorted(ends)  # as parallel's: in the order tasks ended
    assert (work / f"res-{job}" / "1" / "7" / "stdout").read_text() == "7 n1\n"
    assert (work / f"res-{job}" / "1" / "8" / "seq").read_text() == "8\n"


def test_halt_now_on_one_node_stops_the_other_nodes_running_tasks(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    work = job_dir(job_user)
    job, out, rows = run_map(slurm_cluster, job_user, work,
                             "--range 1-20 --split rr --halt now,fail=1", HALT)
    assert out[-1] == "rc 3", (out, (work / f"err-{job}").read_text())  # the failing task's
    summary = json.loads(out[-2])
    assert summary["halted"] is True and summary["exit"] == 3
    by_seq = {int(r[0]): r for r in rows[1:]}
    assert by_seq[1][1] == "n1" and by_seq[1][6] == "3"
    # Task 2 ran on n2 (it made task 1 fail) and was stopped by the halt, not left to sleep.
    assert by_seq[2][1] == "n2" and by_seq[2][7] != "0", rows
    assert all(r[6] != "0" for r in rows[1:]), rows  # no sleeper was let finish
    assert len(rows) - 1 < 20  # no task was started after the halt but those running



# Odd tasks are long (2 s), even ones short: round robin gives every long one to n1.
SKEWED = """'case $(($1 % 2)) in 1) sleep 2;; *) sleep 0.1;; esac; echo "$1 $SLURMD_NODENAME"'"""
# The first task n2 runs from seq 3 on SIGKILLs n2's share (a node lost mid-map), then
# waits to be hung up; every task prints its number and node.
LOSE_N2 = ("""'if [ "$SLURMD_NODENAME" = n2 ] && [ "$1" -ge 3 ] && mkdir lost.d 2>/dev/null; """
           """then """
           """for p in /proc/[0-9]*; do if tr "\\0" "\\n" < $p/cmdline 2>/dev/null """
           """| grep -q -- --node-share && tr "\\0" "\\n" < $p/environ 2>/dev/null """
           """| grep -qx SLURMD_NODENAME=n2; then kill -9 ${p#/proc/}; fi; done; sleep 30; fi; """
           """sleep 0.3; echo "$1 $SLURMD_NODENAME"'""")


def test_dynamic_hand_out_lets_a_node_with_room_take_the_next_task(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    made: dict[str, float] = {}
    hosts: dict[str, dict[int, str]] = {}
    for split in ("rr", "dynamic"):
        work = job_dir(job_user)
        job, out, rows = run_map(slurm_cluster, job_user, work,
                                 f"--range 1-8 -j1 --split {split}", SKEWED)
        assert out[-1] == "rc 0", (out, (work / f"err-{job}").read_text())
        made[split] = json.loads(out[-2])["wall_s"]
        hosts[split] = {int(r[0]): r[1] for r in rows[1:]}
        assert sorted(hosts[split]) == list(range(1, 9))
    long_ones = (1, 3, 5, 7)
    assert {hosts["rr"][n] for n in long_ones} == {"n1"}  # round robin: all on n1
    assert {hosts["dynamic"][n] for n in long_ones} == {"n1", "n2"}, hosts  # shared
    print(f"makespan, 8 tasks (4 x 2 s, 4 x 0.1 s), -j1 on 2 nodes: round robin "
          f"{made['rr']:.2f} s, dynamic {made['dynamic']:.2f} s")


def test_a_node_lost_mid_map_is_reported_and_its_unfinished_tasks_run_elsewhere(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    work = job_dir(job_user)
    job = slurm_cluster.submit(map_job(slurm_cluster, work, "--range 1-10", LOSE_N2),
                               "-N2", "-t", "3", workdir=work, user=job_user)
    out = wait_file(work / f"out-{job}", timeout=180).splitlines()
    err = (work / f"err-{job}").read_text()
    assert ended(slurm_cluster, job) == "COMPLETED", err
    nothing_left(slurm_cluster, job_user, job)
    assert (work / "lost.d").is_dir(), err  # n2's share was killed
    assert out[-1] == "rc 0", (out, err)  # every task ended well, some of them again
    assert "was lost" in err and "run again on this node" in err, err
    printed = [int(line.split()[0]) for line in out[:-2]]
    assert sorted(printed) == list(range(1, 11)), out  # each once: finished ones not again
    rows = [line.split("\t") for line in (work / f"joblog-{job}").read_text().splitlines()]
    assert sorted(int(r[0]) for r in rows[1:]) == list(range(1, 11))
    assert json.loads(out[-2])["tasks"] == 10
