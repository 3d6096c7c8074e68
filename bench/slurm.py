"""A trivial task inside one Slurm allocation: as a fiber of the job's fiberd vs as an srun step.

One batch job (1 task, optionally 1 GPU) starts its own fiberd with
`srun --overlap -n1 fiberd-run &`, as a job author would, and this script,
run inside the job (``--in-job``), times the same task (`true`) three ways,
interleaved, N times each after one untimed warm-up:

- ``fiberctl_run``: `fiberctl run -- true`, the command a job script uses
  (includes starting fiberctl's interpreter);
- ``api_clone``: one Clone through the local API from a process already
  running (what a long-lived caller pays);
- ``srun_step``: `srun --overlap -n1 true`, a new job step.

Two floors are timed in the same rounds: ``python_floor``, this venv's
interpreter doing nothing with no site (`python -I -S -c pass`), the least
any Python command can take, and ``python_site``, the same with site and
the venv's .pth files (`python -c pass`), where fiberctl starts from.

The ratio is srun_step p50 / fiberctl_run p50 (target >= 10); the best a
Python fiberctl could reach is srun_step p50 / python_floor p50
(``ratio_srun_over_python_floor_p50``), so the figures show when the target
is below the interpreter's own start. With
``--hook-runs K`` (K > 0) it also runs bench/hooks.py for the prolog and
epilog wall time and includes its figures. The cluster is the one
``SLURM_CONF`` names; when unset, the bare-host test cluster of this checkout
(which must be up: docker/slurm-cluster/bare-host up). Jobs run as the
invoking user with this checkout's venv. Ends with one JSON line.

    .venv/bin/python bench/slurm.py [-n 50] [--gpu] [--hook-runs 20]

Exit codes: 0 figures printed, 1 the job or the bench failed (one line why), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hooks import percentiles as hook_percentiles  # bench/ is sys.path[0] for a script

from slurm_fiber.client.connection import FiberdClient
from slurm_fiber.client.discovery import discover_socket

CHECKOUT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BARE_HOST = CHECKOUT / "docker" / "slurm-cluster" / "bare-host"
TARGET_RATIO = 10.0
READY_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 600.0
WAYS = ("fiberctl_run", "api_clone", "srun_step", "python_floor", "python_site")


class BenchFailed(Exception):
    """One line: why no figures could be taken."""


def percentiles(samples: list[float]) -> dict[str, float]:
    """n, p50 and p99 in ms, computed as bench/hooks.py computes them."""
    return {"n": len(samples), **hook_percentiles(samples)}


def last_line(text: str) -> str:
    """The last non-empty line of a command's stderr (its reason), or "(no output)"."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def timed(argv: list[str]) -> float:
    """Wall seconds of one run of ``argv``; raises BenchFailed when it fails."""
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True)
    took = time.perf_counter() - start
    if out.returncode != 0:
        raise BenchFailed(f"{' '.join(argv)} exited {out.returncode}: {last_line(out.stderr)}")
    return took


def api_clone(socket: Path) -> float:
    """Wall seconds of one exec Clone of `true` through the API, waited to its exit."""
    start = time.perf_counter()
    with FiberdClient(socket) as client:
        client.clone(exec={"argv": ["true"], "cwd": os.getcwd()}, wait=True)
        end = client.wait_exit()
    took = time.perf_counter() - start
    if end.get("status") != 0:
        raise BenchFailed(f"the API clone of true ended {end}")
    return took


def wait_ready(step: subprocess.Popen[bytes]) -> float:
    """Block until the job's fiberd reports ready; seconds waited. Raises BenchFailed when the
    step exits or READY_TIMEOUT_S passes."""
    start = time.perf_counter()
    while time.perf_counter() - start < READY_TIMEOUT_S:
        if step.poll() is not None:
            raise BenchFailed(f"fiberd-run exited {step.returncode} before it was ready")
        out = subprocess.run([str(BIN / "fiberctl"), "status", "--json"], capture_output=True,
                             text=True)
        if out.returncode == 0 and json.loads(out.stdout).get("ready"):
            return time.perf_counter() - start
        time.sleep(0.1)
    raise BenchFailed(f"fiberd not ready after {READY_TIMEOUT_S:g} s")


def fiberd_env(**extra: str) -> dict[str, str]:
    """The environment of the job's ``fiberd-run`` step: a job of root (the bench times this
    checkout's venv, which no other account may run) names root as its fibers' account,
    explicitly, as a root fiberd requires (``fiber_user``)."""
    root = {"FIBERD_FIBER_USER": "root"} if os.geteuid() == 0 else {}
    return {**os.environ, **root, **extra}


def in_job(runs: int) -> dict[str, object]:
    """The timings, taken inside the allocation: fiberd started, N rounds, fiberd stopped."""
    log = open(f"fiberd-{os.environ['SLURM_JOB_ID']}.log", "wb")  # noqa: SIM115 - the step's
    step = subprocess.Popen(["srun", "--overlap", "-n1", str(BIN / "fiberd-run")],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=fiberd_env())
    try:
        ready_s = wait_ready(step)
        socket = discover_socket()
        ways = {"fiberctl_run": lambda: timed([str(BIN / "fiberctl"), "run", "--", "true"]),
                "api_clone": lambda: api_clone(socket),
                "srun_step": lambda: timed(["srun", "--overlap", "-n1", "true"]),
                "python_floor": lambda: timed([sys.executable, "-I", "-S", "-c", "pass"]),
                "python_site": lambda: timed([sys.executable, "-c", "pass"])}
        samples: dict[str, list[float]] = {way: [] for way in WAYS}
        for round_no in range(runs + 1):
            for way in WAYS:
                took = ways[way]()
                if round_no:  # round 0 warms up
                    samples[way].append(took)
    finally:
        step.terminate()
        step.wait(timeout=30)
        log.close()
    return {"fiberd_ready_s": round(ready_s, 2),
            **{way: percentiles(values) for way, values in samples.items()}}


def cluster_env() -> dict[str, str]:
    """The environment for Slurm commands: SLURM_CONF as set, else this checkout's bare-host
    cluster's exports. Raises BenchFailed when neither names a cluster."""
    if os.environ.get("SLURM_CONF"):
        if not Path(os.environ["SLURM_CONF"]).is_file():
            raise BenchFailed(f"SLURM_CONF {os.environ['SLURM_CONF']} is not a file")
        return dict(os.environ)
    out = subprocess.run([str(BARE_HOST), "env"], capture_output=True, text=True)
    if out.returncode != 0:
        raise BenchFailed("SLURM_CONF is unset and the bare-host cluster is not set up "
                          "(docker/slurm-cluster/bare-host up)")
    pairs = (line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines()
             if line.startswith("export "))
    return os.environ | {k: v.strip("'") for k, v in pairs}


def run_job(env: dict[str, str], runs: int, gpu: bool, work: Path,
            in_job_argv: list[str] | None = None) -> dict[str, object]:
    """Submit the bench job, wait until it leaves the queue, return what it measured (the
    JSON the job's command wrote to the path after its ``--out``; ``in_job_argv``: that
    command's arguments after the interpreter, default this script's ``--in-job -n runs``)."""
    result = work / "figures.json"
    script = work / "bench.sh"
    argv = in_job_argv or [str(Path(__file__).resolve()), "--in-job", "-n", str(runs)]
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {' '.join(argv)} --out {result}\n")
    return submitted(["sbatch", "-n1", *(["--gres=gpu:1"] if gpu else []), str(script)],
                     env, work, result)


def submitted(sbatch: list[str], env: dict[str, str], work: Path, result: Path,
              within: float = JOB_TIMEOUT_S) -> dict[str, object]:
    """Submit ``sbatch`` (its argv, the script last; run in ``work``, its output there),
    wait at most ``within`` s for the job to leave the queue, and return the job id with
    the figures the job wrote to ``result``. BenchFailed (one line) otherwise."""
    out = subprocess.run([*sbatch[:-1], "--parsable", "-t", "15", f"--chdir={work}",
                          f"--output={work}/slurm-%j.out", sbatch[-1]],
                         capture_output=True, text=True, env=env, cwd=work)
    if out.returncode != 0:
        raise BenchFailed(f"sbatch failed: {last_line(out.stderr)}")
    job = out.stdout.strip().split(";")[0]
    deadline = time.monotonic() + within
    while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                         text=True, env=env).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env, capture_output=True)
            raise BenchFailed(f"job {job} still queued or running after {within:g} s")
        time.sleep(0.2)
    if not result.exists():
        said = work / f"slurm-{job}.out"
        raise BenchFailed(f"job {job} left no figures: "
                          f"{last_line(said.read_text()) if said.exists() else 'no output'}")
    return {"job": int(job), **json.loads(result.read_text())}


def hook_figures(runs: int) -> dict[str, object]:
    """bench/hooks.py's JSON line for ``runs`` jobs."""
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "hooks.py"), "--runs",
                          str(runs)], capture_output=True, text=True)
    if out.returncode != 0:
        raise BenchFailed(f"bench/hooks.py failed: {last_line(out.stderr)}")
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    return {hook: figures[hook] for hook in ("prolog", "epilog")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--runs", type=int, default=50, help="timed runs of each way")
    parser.add_argument("--gpu", action="store_true", help="ask the job for --gres=gpu:1")
    parser.add_argument("--hook-runs", type=int, default=0,
                        help="also time the prolog and epilog over this many jobs (hooks.py)")
    parser.add_argument("--in-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.runs < 1:
        parser.error("--runs must be at least 1")
    if opts.in_job and (opts.out is None or "SLURM_JOB_ID" not in os.environ):
        parser.error("--in-job runs inside the bench's own job, with --out")
    try:
        if opts.in_job:
            opts.out.write_text(json.dumps(in_job(opts.runs)))
            return 0
        with tempfile.TemporaryDirectory(prefix="sf-bench-slurm-") as tmp:
            os.chmod(tmp, 0o755)
            figures = run_job(cluster_env(), opts.runs, opts.gpu, Path(tmp))
        if opts.hook_runs > 0:
            figures["hooks"] = hook_figures(opts.hook_runs)
    except BenchFailed as failed:
        print(f"bench/slurm.py: {failed}", file=sys.stderr)
        return 1
    fiberctl, srun = figures["fiberctl_run"]["p50_ms"], figures["srun_step"]["p50_ms"]
    floor = figures["python_floor"]["p50_ms"]
    ratio = round(srun / fiberctl, 2)
    print(f"srun step p50 {srun} ms; fiberctl run p50 {fiberctl} ms; API clone p50 "
          f"{figures['api_clone']['p50_ms']} ms; ratio {ratio} (target >= {TARGET_RATIO:g}); "
          f"python -I -S -c pass p50 {floor} ms (best ratio for a Python command "
          f"{srun / floor:.2f})", file=sys.stderr)
    print(json.dumps({"bench": "slurm", "runs": opts.runs, **figures,
                      "ratio_srun_over_fiberctl_p50": ratio,
                      "ratio_srun_over_api_clone_p50": round(
                          srun / figures["api_clone"]["p50_ms"], 2),
                      "ratio_srun_over_python_floor_p50": round(srun / floor, 2),
                      "target_ratio": TARGET_RATIO, "meets_target": ratio >= TARGET_RATIO}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
