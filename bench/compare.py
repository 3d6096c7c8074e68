"""One bench script from two checkouts, alternated, and its figures side by side.

Runs ``<checkout>/.venv/bin/python <checkout>/bench/<script> [args]`` for checkout
A, then B, then A again, ``--rounds`` times (so a busy moment of the machine falls on
both alike), reads the JSON object each run prints on its last line (every script in
bench/ ends so), and prints each numeric figure's median for A and for B and B/A,
then one JSON line with the same. Each checkout needs its own venv (``./dev setup``).
A run that fails stops the comparison with its exit status and its last lines.

    bench/compare.py --a /tmp/before --b . --rounds 3 tasks.py -n 100 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def flatten(value: Any, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a JSON value, keyed by its dotted path."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, int | float):
        return {prefix: float(value)}
    items: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(str(i), v) for i, v in enumerate(value)]
    out: dict[str, float] = {}
    for key, child in items:
        out.update(flatten(child, f"{prefix}.{key}" if prefix else key))
    return out


def run_once(checkout: Path, script: str, args: list[str]) -> dict[str, float]:
    python = checkout / ".venv" / "bin" / "python"
    cmd = [str(python), str(checkout / "bench" / script), *args]
    proc = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"compare: {' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return flatten(json.loads(lines[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="checkout A (before)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B (after)")
    parser.add_argument("--rounds", type=int, default=3, help="A, B pairs (default 3)")
    parser.add_argument("--keys", default="", help="regex: only figures whose path matches")
    parser.add_argument("script", help="a script in bench/, e.g. tasks.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    opts = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for i in range(opts.rounds):
        for side, checkout in (("a", opts.a), ("b", opts.b)):
            print(f"round {i + 1}/{opts.rounds}: {side} = {checkout}", file=sys.stderr, flush=True)
            runs[side].append(run_once(checkout.resolve(), opts.script, opts.args))
    keep = re.compile(opts.keys)
    keys = [k for k in runs["a"][0] if k in runs["b"][0] and keep.search(k)]
    table = {}
    print(f"{'figure':<60} {'A':>12} {'B':>12} {'B/A':>7}")
    for key in keys:
        a = statistics.median(r[key] for r in runs["a"] if key in r)
        b = statistics.median(r[key] for r in runs["b"] if key in r)
        ratio = b / a if a else None
        table[key] = {"a": a, "b": b, "b_over_a": ratio}
        shown = f"{ratio:7.2f}" if ratio is not None else "      -"
        print(f"{key:<60} {a:12.4g} {b:12.4g} {shown}")
    print(json.dumps({"a": str(opts.a), "b": str(opts.b), "rounds": opts.rounds,
                      "script": opts.script, "figures": table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
