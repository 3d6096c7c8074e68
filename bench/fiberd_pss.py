"""fiberd's own memory beside the interpreter's floor (issue 19: fiberd PSS in a Slurm job).

Each sample measures, in this order, on the same interpreter and environment:

  floor   two fresh interpreters, each read from its own /proc/self/smaps_rollup
          after each stage. The first imports what any fiberd must: ``bare``,
          then ``floor``: asyncio without ssl and ``cryptography``'s ec and ed25519
          (what fiberd verifies grants with, core/trust/). The second: asyncio as
          usual, which imports ssl (libssl, and libcrypto with it), as fiberd does,
          and the same ``cryptography`` modules: ``floor_with_ssl``. Both exit before
          fiberd starts, so none shares pages with another;
  fiberd  fiberd with one grant whose template is warm and no fiber running,
          read from /proc/<pid>/smaps_rollup ``--settle`` seconds after it is ready.

Each reading is PSS (what smaps_rollup says: shared pages split among the processes
mapping them) and USS (Private_Clean + Private_Dirty: what fiberd alone holds).
``pss_over_floor`` is fiberd's PSS / the floor's PSS (``pss_over_floor_with_ssl``: over
the old floor's).

Where:
  standalone (default)  a throwaway site, as bench/scale.py runs it: this venv's
          ``fiberd`` with the standalone home. This process maps libcrypto too, so
          both PSS figures are lower than alone; compare them with each other,
          and USS across runs.
  --slurm  a batch job per sample, as ``--user`` (an unprivileged account), on the
          cluster SLURM_CONF names (else bare-host's of this checkout, which must
          be up with hooks: docker/slurm-cluster/bare-host up). The job measures
          the floor with the site venv's python, starts its fiberd with
          ``srun --overlap -n1 fiberd-run`` (the site venv's, Slurm home, the
          prolog's grant) as docs/slurm.md tells job authors, waits until
          ``fiberctl status`` says ready, and reads fiberd's smaps_rollup (and its
          smaps, kept with ``--keep``) itself.

    .venv/bin/python bench/fiberd_pss.py [--samples 3] [--settle 2]
        [--slurm [--user sfalice] [--site-venv DIR] [--keep]]

Ends with one JSON line. Exit codes: 0 figures printed, 1 a sample failed (one line why).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slurm_fiber.core.runtime.memory import PSS_BUDGET_MB

CHECKOUT = Path(__file__).resolve().parents[1]
# The floor, run as a script with one argument (FLOORS): its own smaps_rollup after each
# stage, one JSON line.
FLOOR_SCRIPT = """\
import gc, json, sys
def rollup():
    gc.collect()
    return open("/proc/self/smaps_rollup").read()
stages = {"bare": rollup()}
if sys.argv[1] == "fiberd":
    sys.modules["ssl"] = None  # while asyncio is imported: the floor without TLS
    import asyncio
    del sys.modules["ssl"]
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519
    stages["floor"] = rollup()
else:
    import asyncio
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519
    stages["floor_with_ssl"] = rollup()
print(json.dumps(stages))
"""
FLOORS = ("fiberd", "with_ssl")
RUNUSER = shutil.which("runuser", path="/usr/sbin:/sbin:/usr/bin:/bin") or "runuser"
READY_S = 60  # how long a job waits for its fiberd to be ready
JOB_SCRIPT = """#!/bin/sh
SF="{bin}"
id=$SLURM_JOB_ID
for floor in {floors}; do
  "$SF/python" floor.py $floor > "floor-$floor-$id.json" || exit 1
done
srun --overlap -n1 "$SF/fiberd-run" > "fiberd-$id.log" 2>&1 &
i=0
until "$SF/fiberctl" status --json > "status-$id.json" 2>/dev/null \\
    && grep -q '"ready": true' "status-$id.json"; do
  i=$((i+1))
  if [ $i -gt {ticks} ]; then echo "fiberd not ready" > "failed-$id"; exit 1; fi
  sleep 0.1
done
sleep {settle}
pid=$(sed 's/.*"pid": \\([0-9]*\\).*/\\1/' "status-$id.json")
cat "/proc/$pid/smaps_rollup" > "fiberd-$id.rollup"
cat "/proc/$pid/smaps" > "fiberd-$id.smaps"
"""


def reading(rollup: str) -> dict[str, float]:
    """PSS and USS in MB from the text of a smaps_rollup."""
    kb = {}
    for line in rollup.splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            kb[key] = int(value.split()[0])
    uss = kb["Private_Clean"] + kb["Private_Dirty"]
    return {"pss_mb": round(kb["Pss"] / 1024, 2), "uss_mb": round(uss / 1024, 2)}


def floor_figures(runs: list[dict[str, str]]) -> dict[str, dict[str, float]]:
    """Each stage's reading from the FLOORS runs' stages (``bare``: the last run's)."""
    return {stage: reading(text) for run in runs for stage, text in run.items()}


def floor_here(python: str) -> dict[str, dict[str, float]]:
    """The floors measured by fresh interpreters ``python`` of this machine."""
    runs = [subprocess.run([python, "-c", FLOOR_SCRIPT, floor], capture_output=True,
                           text=True, check=True).stdout for floor in FLOORS]
    return floor_figures([json.loads(out) for out in runs])


def sample(floor: dict[str, dict[str, float]], fiberd: dict[str, float]) -> dict[str, Any]:
    return {"floor": floor, "fiberd": fiberd, **{
        f"pss_over_{stage}": round(fiberd["pss_mb"] / floor[stage]["pss_mb"], 3)
        for stage in ("floor", "floor_with_ssl")}}


def standalone_sample(settle: float) -> dict[str, Any]:
    """One throwaway site: the floor, then its fiberd with one grant warm."""
    from scale import ScaleSite  # bench/ is sys.path[0] for a script

    floor = floor_here(sys.executable)
    with tempfile.TemporaryDirectory(prefix="slurm-fiber-pss-") as tmp:
        site = ScaleSite.with_grants(Path(tmp), ("json",), 1)
        site.start()
        try:
            site.wait_all_warm(1, 120)
            time.sleep(settle)
            fiberd = reading(Path(f"/proc/{site.pid}/smaps_rollup").read_text())
        finally:
            site.stop(within=30)
    return sample(floor, fiberd)


def cluster_env() -> dict[str, str]:
    """This environment with SLURM_CONF: the caller's, else bare-host's of this checkout."""
    if os.environ.get("SLURM_CONF"):
        return dict(os.environ)
    out = subprocess.run([str(CHECKOUT / "docker/slurm-cluster/bare-host"), "env"],
                         capture_output=True, text=True, check=True)
    env = dict(os.environ)
    for line in out.stdout.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = value.strip("'\"")
    return env


def slurm_sample(user: str, site_venv: Path, settle: float, env: dict[str, str],
                 keep: bool) -> dict[str, Any]:
    """One batch job as ``user``: the floor, then the job's fiberd with its grant warm
    (``keep``: leave the job's work dir, with fiberd's smaps and log, and say where)."""
    account = pwd.getpwnam(user)
    work = Path(tempfile.mkdtemp(prefix="slurm-fiber-pss-", dir="/tmp"))
    try:
        os.chmod(work, 0o700)
        (work / "floor.py").write_text(FLOOR_SCRIPT)
        script = work / "job.sh"
        script.write_text(JOB_SCRIPT.format(bin=site_venv / "bin", ticks=READY_S * 10,
                                            settle=settle, floors=" ".join(FLOORS)))
        for path in (work, work / "floor.py", script):
            os.chown(path, account.pw_uid, account.pw_gid)
        job_env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
                   **{k: v for k, v in env.items() if k.startswith("SLURM_")}}
        out = subprocess.run([RUNUSER, "-u", user, "--", "sbatch", "--parsable", "--wait",
                              f"--chdir={work}", f"--output={work}/slurm-%j.out", str(script)],
                             capture_output=True, text=True, env=job_env, cwd="/",
                             timeout=READY_S + settle + 120)
        job = out.stdout.strip().split(";")[0]
        rollup = work / f"fiberd-{job}.rollup"
        if out.returncode != 0 or not rollup.exists():
            why = [p.read_text().strip() for p in work.glob(f"failed-{job}")]
            log = work / f"fiberd-{job}.log"
            raise RuntimeError(f"job {job or '?'} failed (sbatch {out.returncode}: "
                               f"{out.stderr.strip()}) {why} "
                               f"{log.read_text()[-1500:] if log.exists() else ''}")
        floor = floor_figures([json.loads((work / f"floor-{name}-{job}.json").read_text())
                               for name in FLOORS])
        return {"job": int(job), **sample(floor, reading(rollup.read_text()))}
    finally:
        if keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def summary(samples: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each figure across the samples, in sample order."""
    return {
        "fiberd_pss_mb": [s["fiberd"]["pss_mb"] for s in samples],
        "fiberd_uss_mb": [s["fiberd"]["uss_mb"] for s in samples],
        "floor_pss_mb": [s["floor"]["floor"]["pss_mb"] for s in samples],
        "floor_uss_mb": [s["floor"]["floor"]["uss_mb"] for s in samples],
        "floor_with_ssl_pss_mb": [s["floor"]["floor_with_ssl"]["pss_mb"] for s in samples],
        "bare_pss_mb": [s["floor"]["bare"]["pss_mb"] for s in samples],
        "pss_over_floor": [s["pss_over_floor"] for s in samples],
        "pss_over_floor_with_ssl": [s["pss_over_floor_with_ssl"] for s in samples],
        "budget_pss_mb": [PSS_BUDGET_MB],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds between fiberd ready and the reading")
    parser.add_argument("--slurm", action="store_true", help="in Slurm jobs (see above)")
    parser.add_argument("--user", default="sfalice", help="the job user (--slurm)")
    parser.add_argument("--site-venv", type=Path,
                        help="the site venv jobs run (default: bare-host's)")
    parser.add_argument("--keep", action="store_true",
                        help="keep each job's work dir (fiberd's smaps, log) (--slurm)")
    opts = parser.parse_args()
    samples = []
    try:
        if opts.slurm:
            env = cluster_env()
            site_venv = opts.site_venv or Path(env.get("SLURM_FIBER_SITE_VENV", ""))
            if not (site_venv / "bin" / "fiberd-run").exists():
                raise RuntimeError(f"no fiberd-run in {site_venv}/bin (bare-host up, or "
                                   "--site-venv)")
        for n in range(opts.samples):
            if opts.slurm:
                got = slurm_sample(opts.user, site_venv, opts.settle, env, opts.keep)
            else:
                got = standalone_sample(opts.settle)
            print(f"sample {n}: {got}", file=sys.stderr)
            samples.append(got)
    except (RuntimeError, subprocess.SubprocessError, OSError, KeyError) as err:
        print(json.dumps({"bench": "fiberd_pss", "failed": str(err)}))
        return 1
    print(json.dumps({"bench": "fiberd_pss", "where": "slurm" if opts.slurm else "standalone",
                      "summary": summary(samples), "samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
