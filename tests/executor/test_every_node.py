"""``Executor(nodes="all")`` in a 2-node job on the real cluster, run as a job user.

The job starts both nodes' fiberd (as tests/cli/test_fibermap_nodes.py's jobs do), then
runs a Python script with the site's interpreter on n1: two calls, one slot per node,
each of which returns only once both have started (files in the work dir, bounded), so
they can only both succeed when they run at once, one on each node: n2's through the
relay srun runs there (slurm_fiber/client/nodes/). Each returns its node and prints it; the
future keeps what it printed. Then a node lost mid-call: the first call that runs on n2
SIGKILLs n2's relay; the Executor names n2 on stderr and runs that call again on n1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.barehost.fiberjobkit import ended, wait_file
from tests.cli.test_fibermap_nodes import PRELUDE, nothing_left

if TYPE_CHECKING:
    from tests.barehost.clusterkit import SlurmCluster
    from tests.security.userkit import JobUser

    WorkDir = Callable[[JobUser], Path]

pytestmark = pytest.mark.slurm

SCRIPT = '''import json, sys
from slurm_fiber import Executor


def meet(i, work):  # travels by value (cloudpickle): defined in __main__
    import os, pathlib, time
    where = os.environ["SLURMD_NODENAME"]
    pathlib.Path(work, f"met-{i}-{where}").touch()
    for _ in range(1200):
        if len(list(pathlib.Path(work).glob("met-*"))) >= 2:
            break
        time.sleep(0.05)
    else:
        raise TimeoutError("the other call never started")
    print(f"call {i} printed on {where}")
    return where


with Executor(nodes="all", max_workers=1, windows=sys.argv[2] == "windows") as ex:
    futures = [ex.submit(meet, i, sys.argv[1]) for i in range(2)]
    where = [f.result(timeout=120) for f in futures]
    printed = [f.stdout() for f in futures]
print(json.dumps({"where": where, "printed": printed}))
'''
BODY = """"$SF/python" "{script}" "$PWD" {how} > "out-$id.tmp" 2> "err-$id"
echo "rc $?" >> "out-$id.tmp"
mv "out-$id.tmp" "out-$id"
"""


def test_executor_nodes_all_runs_calls_on_both_nodes(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    for how in ("plain", "windows"):  # Executor(windows=True): nodes="all" as without them
        work = job_dir(job_user)
        script = work / "every_node.py"
        script.write_text(SCRIPT)
        script.chmod(0o644)
        body = PRELUDE.format(bin=slurm_cluster.site_bin, work=work) + BODY.format(
            script=script, how=how)
        job = slurm_cluster.submit(body, "-N2", "-t", "3", workdir=work, user=job_user)
        out = wait_file(work / f"out-{job}", timeout=180).splitlines()
        err = (work / f"err-{job}").read_text()
        assert ended(slurm_cluster, job) == "COMPLETED", (how, err)
        nothing_left(slurm_cluster, job_user, job)
        assert out[-1] == "rc 0", (how, out, err)
        result = json.loads(out[-2])
        assert sorted(result["where"]) == ["n1", "n2"], (how, result)
        assert result["printed"] == [f"call {i} printed on {node}\n"
                                     for i, node in enumerate(result["where"])]
        # echo: each call's output also on the caller's stdout
        assert sorted(out[:-2]) == sorted(p.strip() for p in result["printed"]), (how, out)


LOSE = '''import json, sys
from slurm_fiber import Executor


def call(i, work):  # the first call on n2 kills n2's relay (its node lost), then waits
    import os, pathlib, signal, time
    where = os.environ["SLURMD_NODENAME"]
    pathlib.Path(work, f"started-{i}-{where}").touch()
    if where == "n2" and not os.path.exists(os.path.join(work, "lost.d")):
        os.mkdir(os.path.join(work, "lost.d"))
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\\0")
                env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\\0")
            except OSError:
                continue
            if b"slurm_fiber.client.nodes.relay" in argv and b"SLURMD_NODENAME=n2" in env:
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(30)
    return where


with Executor(nodes="all", max_workers=1) as ex:
    where = list(ex.map(call, range(4), [sys.argv[1]] * 4))
print(json.dumps(where))
'''


def test_executor_nodes_all_runs_a_lost_nodes_call_again_on_the_other(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    work = job_dir(job_user)
    script = work / "lose.py"
    script.write_text(LOSE)
    script.chmod(0o644)
    body = PRELUDE.format(bin=slurm_cluster.site_bin, work=work) + BODY.format(script=script,
                                                                               how="plain")
    job = slurm_cluster.submit(body, "-N2", "-t", "3", workdir=work, user=job_user)
    out = wait_file(work / f"out-{job}", timeout=180).splitlines()
    err = (work / f"err-{job}").read_text()
    assert ended(slurm_cluster, job) == "COMPLETED", err
    assert (work / "lost.d").is_dir(), err  # a call on n2 killed n2's relay
    assert out[-1] == "rc 0", (out, err)
    assert "slurm_fiber.Executor: node n2 lost (" in err, err
    where = json.loads(out[-2])
    killer = [int(p.name.split("-")[1]) for p in work.glob("started-*-n2")]
    assert len(killer) == 1, killer  # no call started on n2 after it was lost
    assert where[killer[0]] == "n1", where  # that call ran again on n1, to its end
    assert where.count("n1") >= 3
