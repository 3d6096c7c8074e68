"""Skewed tasks over a 2-node Slurm job: dynamic hand-out against round robin, same run.

One batch job of two nodes starts a fiberd on each (`srun --overlap --ntasks-per-node=1
fiberd-run &`, as a job author would) and this script, run as the job's batch script
(``--in-job``), times the same map four ways, interleaved, ``--rounds`` times each:
``fiberctl map --nodes all`` with ``--split rr`` (round robin by sequence number) and
``--split dynamic`` (a node takes the next task when it has a free slot), each with the
nodes' shares reading the spool in the shared working directory (``--via spool``, the
default) and with the map handing tasks out itself over srun relays (``--via relay``).
The tasks are skewed on purpose: odd ones sleep ``--long`` seconds, even ones
``--short``, so round robin gives every long task to the first node. The makespan is the
map command's wall time (from its start to its exit, what a job script waits); the
figures also give each map's own ``wall_s`` and how many tasks each node ran. The
cluster is the one ``SLURM_CONF`` names; when unset, the bare-host test cluster of this
checkout (which must be up: docker/slurm-cluster/bare-host up). The job runs as the
invoking user with this checkout's venv, or (root, ``--user NAME``: a root fiberd needs
a ``fiber_user``) as that user with the cluster's site venv (``$SLURM_FIBER_SITE_VENV``)
and a copy of these scripts in its own work dir. Ends with one JSON line.

    .venv/bin/python bench/nodes.py [--tasks 8] [--long 2] [--short 0.1] [-j 1] [--rounds 1]
                                    [--user sfalice]

Exit codes: 0 figures printed, 1 the job or the bench failed (one line why), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slurm import (  # bench/ is sys.path[0] for a script
    BenchFailed,
    cluster_env,
    last_line,
    submitted,
)

BIN = Path(sys.executable).parent
JOB_TIMEOUT_S = 900.0
READY_S = 60
WAYS = (("spool", "rr"), ("spool", "dynamic"), ("relay", "rr"), ("relay", "dynamic"))


def one_map(via: str, split: str, opts: argparse.Namespace) -> dict[str, object]:
    """Run the map once in this job; its makespan and summary."""
    task = (f"case $(($1 % 2)) in 1) sleep {opts.long};; *) sleep {opts.short};; esac; "
            "echo \"$1 $SLURMD_NODENAME\"")
    argv = [str(BIN / "fiberctl"), "map", "--nodes", "all", "--via", via, "--split", split,
            f"-j{opts.jobs}", "--json", "--range", f"1-{opts.tasks}", "--", "sh", "-c", task,
            "sh", "{}"]
    begun = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    made = time.monotonic() - begun
    if out.returncode != 0:
        raise BenchFailed(f"map --via {via} --split {split} exited {out.returncode}: "
                          f"{last_line(out.stderr)}")
    lines = out.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    hosts: dict[str, list[int]] = {}
    for line in lines[:-1]:
        seq, node = line.split()
        hosts.setdefault(node, []).append(int(seq))
    return {"makespan_s": round(made, 3), "wall_s": summary.get("wall_s"),
            "tasks_by_node": {n: sorted(s) for n, s in sorted(hosts.items())}}


def in_job(opts: argparse.Namespace) -> dict[str, object]:
    """(The batch script) both nodes' fiberd, then the maps, interleaved."""
    log = open("fiberd.log", "wb")  # noqa: SIM115 - the fiberd steps' whole life
    fiberd = subprocess.Popen(["srun", "--overlap", "--ntasks-per-node=1", "-N2",
                               str(BIN / "fiberd-run")], stdout=log, stderr=log)
    try:
        ready = subprocess.run(["srun", "--overlap", "--ntasks-per-node=1", "-N2",
                                str(BIN / "fiberctl"), "wait", "--timeout", str(READY_S)],
                               capture_output=True, text=True, timeout=READY_S + 30)
        if ready.returncode != 0:
            raise BenchFailed(f"fiberd not ready on both nodes: {last_line(ready.stderr)} "
                              f"(fiberd-run: {last_line(Path('fiberd.log').read_text())})")
        runs: dict[str, list[dict[str, object]]] = {f"{v}_{s}": [] for v, s in WAYS}
        for _ in range(opts.rounds):
            for via, split in WAYS:
                runs[f"{via}_{split}"].append(one_map(via, split, opts))
        return {way: {"makespan_s": statistics.median(float(str(r["makespan_s"]))
                                                      for r in done),
                      "runs": done} for way, done in runs.items()}
    finally:
        fiberd.terminate()
        fiberd.wait(30)


def run_job(env: dict[str, str], opts: argparse.Namespace, work: Path) -> dict[str, object]:
    """Submit the 2-node job, wait until it leaves the queue, return its figures."""
    result = work / "figures.json"
    script = work / "bench.sh"
    python, here, runner = sys.executable, Path(__file__).resolve(), []
    if opts.user:  # the job user's: the site venv, the scripts copied where it can read
        import pwd
        import shutil

        account = pwd.getpwnam(opts.user)
        python = str(Path(env["SLURM_FIBER_SITE_VENV"]) / "bin" / "python")
        for name in ("nodes.py", "slurm.py", "hooks.py"):
            shutil.copy(here.parent / name, work / name)
        here = work / "nodes.py"
        os.chown(work, account.pw_uid, account.pw_gid)
        runner = ["runuser", "-u", opts.user, "--"]
    argv = [python, str(here), "--in-job", "--tasks",
            str(opts.tasks), "--long", str(opts.long), "--short", str(opts.short), "-j",
            str(opts.jobs), "--rounds", str(opts.rounds), "--out", str(result)]
    script.write_text(f"#!/bin/sh\ncd {work}\nexec {' '.join(argv)}\n")
    for path in work.iterdir():
        path.chmod(0o644)
    return submitted([*runner, "sbatch", "-N2", "--ntasks-per-node=1", str(script)], env,
                     work, result, JOB_TIMEOUT_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=8, help="tasks in each map")
    parser.add_argument("--long", type=float, default=2.0, help="seconds an odd task sleeps")
    parser.add_argument("--short", type=float, default=0.1,
                        help="seconds an even task sleeps")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="slots per node")
    parser.add_argument("--rounds", type=int, default=1, help="times each way is timed")
    parser.add_argument("--user", help="(root) run the job as this user, with the cluster's "
                        "site venv")
    parser.add_argument("--in-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.tasks < 2 or opts.jobs < 1 or opts.rounds < 1:
        parser.error("--tasks must be at least 2, -j and --rounds at least 1")
    if opts.in_job and (opts.out is None or "SLURM_JOB_ID" not in os.environ):
        parser.error("--in-job runs inside the bench's own job, with --out")
    try:
        if opts.in_job:
            opts.out.write_text(json.dumps(in_job(opts)))
            return 0
        with tempfile.TemporaryDirectory(prefix="sf-bench-nodes-") as tmp:
            os.chmod(tmp, 0o755)
            figures = run_job(cluster_env(), opts, Path(tmp))
    except BenchFailed as failed:
        print(f"bench/nodes.py: {failed}", file=sys.stderr)
        return 1
    ways = ", ".join(f"{way} {figures[way]['makespan_s']:.2f} s"
                     for way in (f"{v}_{s}" for v, s in WAYS))
    print(f"makespan, {opts.tasks} tasks ({(opts.tasks + 1) // 2} x {opts.long:g} s, "
          f"{opts.tasks // 2} x {opts.short:g} s), -j{opts.jobs} on 2 nodes: {ways}",
          file=sys.stderr)
    print(json.dumps({"bench": "nodes", "tasks": opts.tasks, "long_s": opts.long,
                      "short_s": opts.short, "jobs": opts.jobs, "rounds": opts.rounds,
                      **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
