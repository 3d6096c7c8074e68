"""The event loop's lag while fiberd's grantdir delivers 5,000 files (issue 19, item 3).

A directory of ``--files`` files (every ``--valid-every``-th a JWT-shaped grant, the
rest junk), each problem written to a real audit log as fiberd writes it (fsync per
``--fsync``), is delivered once, then scanned again ``--rescans`` times unchanged. A
ticker task on the same loop wakes every millisecond and records how late it woke: the
lag. Two ways, in one run:

  whole:   ``GrantDir.poll()`` called on the loop (every file read in one go, as
           fiberd's grantdir did before it scanned in slices);
  sliced:  ``GrantDir.scan()``, what fiberd runs now (slices of ``SLICE`` names, the loop
           free between them; unchanged files are not read again).

Prints the max and p99 lag of the first delivery and of the rescans for each, then one
JSON line. Target: no stall over 50 ms. Figures on a shared machine are noisy; compare
the two rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import jwt

from slurm_fiber.core.audit.log import AuditEvent, AuditLog
from slurm_fiber.core.clock import SystemClock
from slurm_fiber.core.seam import GrantEvent
from slurm_fiber.homes.grantdir import SLICE, GrantDir
from slurm_fiber.homes.problem import Problem


def fill(root: Path, files: int, valid_every: int) -> None:
    root.mkdir(mode=0o700)
    past = time.time() - 3600  # written earlier: settled, as a long-lived grantdir is
    for i in range(files):
        path = root / f"f{i:05d}.jwt"
        if i % valid_every == 0:
            path.write_bytes(jwt.encode({"sub": f"g{i}"}, "bench-key", algorithm="HS256")
                             .encode())
        else:
            path.write_bytes(b"not a token " * (i % 40 + 1))
        os.utime(path, (past, past))


async def lag_of(work: Callable[[], Awaitable[object]]) -> list[float]:
    """Run ``work`` while a 1 ms ticker records how late each of its wake-ups came (s)."""
    lags: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(max(0.0, time.perf_counter() - start - 0.001))

    running = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.01)
    lags.clear()
    await work()
    await asyncio.sleep(0.01)  # the ticker records the last stall
    done = True
    await running
    return lags


def summary(lags: list[float]) -> dict[str, float]:
    ordered = sorted(lags) or [0.0]
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {"max_ms": round(ordered[-1] * 1e3, 1), "p99_ms": round(p99 * 1e3, 1),
            "median_ms": round(statistics.median(ordered) * 1e3, 2)}


async def measure(mode: str, args: argparse.Namespace, work_dir: Path) -> dict[str, object]:
    root = work_dir / f"grants-{mode}"
    fill(root, args.files, args.valid_every)
    audit = AuditLog(work_dir / f"audit-{mode}.jsonl", args.fsync)

    def report(problem: Problem) -> None:
        audit.write(AuditEvent.PROBLEM, code=problem.code, subject=problem.subject,
                    reason=problem.reason)

    gd = GrantDir(root, SystemClock(), 1.0, on_problem=report)
    delivered: list[GrantEvent] = []

    async def once() -> None:
        if mode == "whole":
            delivered.extend(gd.poll())
        else:
            delivered.extend(await gd.scan())

    started = time.perf_counter()
    first = await lag_of(once)
    first_s = time.perf_counter() - started

    async def rescans() -> None:
        for _ in range(args.rescans):
            await once()
            await asyncio.sleep(0)

    later = await lag_of(rescans)
    audit.close()
    return {"mode": mode, "grants": len(delivered), "audited": audit.seq,
            "first_s": round(first_s, 3), "first": summary(first), "rescans": summary(later)}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--valid-every", type=int, default=50)
    parser.add_argument("--rescans", type=int, default=3)
    parser.add_argument("--fsync", choices=("always", "never"), default="always")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-grantdir-") as tmp:
        rows = [await measure(mode, args, Path(tmp)) for mode in ("whole", "sliced")]
    for row in rows:
        first, later = row["first"], row["rescans"]
        print(f"{row['mode']:7} first delivery {row['first_s']:.2f} s: lag max "
              f"{first['max_ms']} ms p99 {first['p99_ms']} ms; {args.rescans} unchanged "
              f"rescans: lag max {later['max_ms']} ms p99 {later['p99_ms']} ms "
              f"({row['grants']} grants, {row['audited']} problems audited)",
              file=sys.stderr)
    print(json.dumps({"files": args.files, "slice": SLICE, "fsync": args.fsync,
                      "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
