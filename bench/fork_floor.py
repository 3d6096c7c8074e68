"""Baselines for bench/clone.py: the cold start and the raw fork floor, same preloads.

``cold_start(preloads, n)``: wall seconds of ``sys.executable -c "import <preloads>"``
(the venv's own interpreter, never a PATH shim). ``fork_floor(preloads, n)``:
in a child interpreter that has imported the preloads and frozen its heap,
the wall seconds of fork → child ``os._exit(0)`` → ``waitpid``. Both block;
run them from a script, not from fiberd. ``python bench/fork_floor.py
[-n N] MODULE...`` prints one JSON line with the p50/p99 of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

_FLOOR = """
import gc, json, os, sys, time
for m in sys.argv[2:]:
    __import__(m)
gc.collect(); gc.freeze()
out = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""


def cold_start(preloads: list[str], n: int) -> list[float]:
    """Seconds per cold ``python -c "import ..."``, n runs."""
    code = "import " + ", ".join(preloads) if preloads else "pass"
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        out.append(time.perf_counter() - t)
    return out


def fork_floor(preloads: list[str], n: int) -> list[float]:
    """Seconds per raw fork+exit+wait from a process holding ``preloads``, n runs."""
    done = subprocess.run([sys.executable, "-c", _FLOOR, str(n), *preloads], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout)


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50 and p99 in milliseconds."""
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50_ms": round(statistics.median(samples) * 1000, 3),
            "p99_ms": round(cuts[98] * 1000, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=50, help="samples per path (default 50)")
    parser.add_argument("modules", nargs="*",
                        default=["json", "decimal", "asyncio", "email", "http.client"])
    opts = parser.parse_args()
    cold = cold_start(opts.modules, max(3, opts.n // 5))
    floor = fork_floor(opts.modules, opts.n)
    print(json.dumps({"preloads": opts.modules, "cold_start": percentiles(cold),
                      "fork_floor": percentiles(floor),
                      "cold_over_floor": round(statistics.median(cold)
                                               / statistics.median(floor), 1)}))


if __name__ == "__main__":
    main()
