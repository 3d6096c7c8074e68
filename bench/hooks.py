"""Prolog and epilog wall time, invoked as slurmd invokes them, beside a bare-interpreter baseline.

Each round runs, for one fresh job id, the real console scripts under
``env -i`` with a 22.05 prolog/epilog environment (no PATH, no HOME) and a
site config in a temporary directory: a job of a non-root-owned uid with
one GPU, a minted token, a lease granted and claimed in the root-only lease
area, and no cgroup delegation (pass ``--delegate`` to add it where cgroup
v2 is writable). A second site
without an issuer key (no minting) is timed in the same
rounds ("prolog_no_mint"), to show what minting costs. The baseline is
``python -c pass`` with the same interpreter, in the same rounds,
interleaved. The prolog delays every job start (target p50 <= 150 ms each);
the figures also give each hook's cost above the bare interpreter start, the
part this project controls. Ends with one JSON line.

    .venv/bin/python bench/hooks.py [--runs 30] [--delegate]
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

from slurm_fiber.core.trust.mint import save_private_key
from slurm_fiber.testing import Issuer

TARGET_P50_S = 0.150
BIN = Path(sys.executable).parent
CGROUP2 = Path("/sys/fs/cgroup/unified")


def site(root: Path, delegate: bool, mint: bool = True) -> Path:
    """Write a site (key, JWKS, config) under ``root``; the config path."""
    root.mkdir(mode=0o755, exist_ok=True)
    save_private_key(Issuer("bench", root / "site.jwks.json").key, root / "site.key")
    lines = ['issuer = "bench"', f'state_root = "{root / "state"}"']
    if mint:
        lines.append(f'issuer_key = "{root / "site.key"}"')
    if delegate:
        lines += ["delegate_cgroup = true", f'cgroup_parent = "{CGROUP2}/sf-bench-{os.getpid()}"']
    lines += ["[trust]", f'bench = "{root / "site.jwks.json"}"', "[grant]", 'devices = ["gpu"]']
    config = root / "site.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def job_env(config: Path, job_id: int, context: str) -> list[str]:
    env = {"SLURM_FIBER_CONFIG": str(config), "SLURM_JOB_ID": str(job_id),
           "SLURM_JOBID": str(job_id), "SLURM_JOB_UID": "65534", "SLURM_JOB_GID": "65534",
           "SLURM_JOB_USER": "nobody", "SLURM_JOB_PARTITION": "debug", "SLURMD_NODENAME": "n1",
           "SLURM_CLUSTER_NAME": "bench", "SLURM_JOB_GPUS": str(job_id % 2),
           "CUDA_VISIBLE_DEVICES": str(job_id % 2), "SLURM_SCRIPT_CONTEXT": context}
    return [f"{k}={v}" for k, v in env.items()]


def timed(argv: list[str]) -> float:
    """Wall seconds of one run of ``argv``; raises when it fails."""
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True)
    took = time.perf_counter() - start
    if out.returncode != 0 or out.stderr:
        raise SystemExit(f"{argv[-1]} failed ({out.returncode}): {out.stderr.strip()}")
    return took


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50_ms": round(statistics.median(ordered) * 1000, 1), "p99_ms": round(p99 * 1000, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="jobs to run the hooks for")
    parser.add_argument("--delegate", action="store_true",
                        help="also delegate a cgroup v2 subtree per job (needs root)")
    opts = parser.parse_args()
    samples: dict[str, list[float]] = {"baseline": [], "prolog": [], "epilog": [],
                                       "prolog_no_mint": []}
    with tempfile.TemporaryDirectory(prefix="sf-bench-hooks-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)
        config = site(root, opts.delegate)
        lean = site(root / "lean", delegate=False, mint=False)
        baseline = ["/usr/bin/env", "-i", sys.executable, "-c", "pass"]
        for job_id in range(1, opts.runs + 1):
            samples["baseline"].append(timed(baseline))
            for hook in ("prolog", "epilog"):
                argv = ["/usr/bin/env", "-i", *job_env(config, job_id, f"{hook}_slurmd"),
                        str(BIN / f"slurm-fiber-{hook}")]
                samples[hook].append(timed(argv))
            argv = ["/usr/bin/env", "-i", *job_env(lean, job_id, "prolog_slurmd"),
                    str(BIN / "slurm-fiber-prolog")]
            samples["prolog_no_mint"].append(timed(argv))
            timed(["/usr/bin/env", "-i", *job_env(lean, job_id, "epilog_slurmd"),
                   str(BIN / "slurm-fiber-epilog")])  # frees its GPU lease; not timed
        if opts.delegate:
            parent = CGROUP2 / f"sf-bench-{os.getpid()}"
            for leftover in (parent / "n1", parent):
                if leftover.exists():
                    leftover.rmdir()
    figures = {name: percentiles(values) for name, values in samples.items()}
    base = figures["baseline"]["p50_ms"]
    for hook in ("prolog", "epilog", "prolog_no_mint"):
        figures[hook]["above_baseline_p50_ms"] = round(figures[hook]["p50_ms"] - base, 1)
        figures[hook]["meets_target"] = figures[hook]["p50_ms"] <= TARGET_P50_S * 1000
        print(f"{hook}: p50 {figures[hook]['p50_ms']} ms, p99 {figures[hook]['p99_ms']} ms "
              f"(baseline python -c pass p50 {base} ms; target p50 <= "
              f"{TARGET_P50_S * 1000:.0f} ms)", file=sys.stderr)
    print(json.dumps({"bench": "hooks", "runs": opts.runs, "delegate": opts.delegate,
                      "target_p50_ms": TARGET_P50_S * 1000, **figures}))


if __name__ == "__main__":
    main()
