"""Latency measurements shared by ``slurm-fiber quickstart`` and the benchmarks in bench/.

``cold_start`` times a fresh interpreter importing the preloads (the venv's
own ``sys.executable``, never a PATH shim that adds its own start-up cost);
``clone_round_trips`` times Clones through fiberd's real socket, each one
clone → fiber runs → exit event, on one connection, as a client holding a
connection would; ``percentiles`` and ``ratio`` turn samples into the
figures printed. Every function blocks and raises ``MeasureFailed`` (one
line) when a measured run does not do what it should, so a figure is never
taken from a failed run.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from slurm_fiber.client.connection import FiberdClient, Missed, Refused, Unreachable

MODES = ("call", "exec")
CALL_TARGET = "json:dumps"  # in every template that preloads json; returns its argument as text
EXEC_ARGV = ("true",)


class MeasureFailed(Exception):
    """A measured run failed (the one-line reason names what and how)."""


def import_line(preloads: Sequence[str]) -> str:
    """The ``-c`` program a cold start runs: ``import a, b`` (``pass`` for none)."""
    return "import " + ", ".join(preloads) if preloads else "pass"


def cold_start(preloads: Sequence[str], n: int, python: str = sys.executable) -> list[float]:
    """Wall seconds of ``python -c "import <preloads>"``, n runs. Raises MeasureFailed."""
    code = import_line(preloads)
    out = []
    for _ in range(n):
        start = time.perf_counter()
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
        out.append(time.perf_counter() - start)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise MeasureFailed(f"cold start `{python} -c {code!r}` failed: {last}")
    return out


def clone_fields(mode: str) -> dict[str, Any]:
    """The clone request fields of one measured Clone in ``mode`` (call or exec)."""
    if mode == "call":
        return {"call": {"target": CALL_TARGET, "args": [[1, 2, 3]]}}
    if mode == "exec":
        return {"exec": {"argv": list(EXEC_ARGV), "cwd": "/"}}
    raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")


def _check_exit(mode: str, end: dict[str, object]) -> None:
    if end.get("status") != 0 or "error" in end:
        raise MeasureFailed(f"a {mode}-mode fiber failed: status {end.get('status')}, "
                            f"error {end.get('error')}")
    if mode == "call" and end.get("result") != "[1, 2, 3]":
        raise MeasureFailed(f"a call-mode fiber returned {end.get('result')!r}, "
                            "not json.dumps([1, 2, 3])")


def clone_round_trips(socket: str | os.PathLike[str], mode: str, n: int, *,
                      grant: str | None = None, warmup: int = 3,
                      pause: float = 0.0) -> list[float]:
    """Wall seconds per Clone round trip (request → fiber started, ran, exit event received),
    n runs after ``warmup`` untimed ones, on one connection, ``pause`` seconds (untimed)
    after each.

    Raises MeasureFailed on a miss, a refusal, a broken connection or a failed fiber.
    """
    fields = clone_fields(mode)
    if grant is not None:
        fields["grant"] = grant
    out = []
    try:
        with FiberdClient(socket) as client:
            for i in range(warmup + n):
                start = time.perf_counter()
                client.clone(wait=True, **fields)
                end = client.wait_exit()
                elapsed = time.perf_counter() - start
                _check_exit(mode, end)
                if i >= warmup:
                    out.append(elapsed)
                if pause:
                    time.sleep(pause)
    except (Missed, Refused, Unreachable) as err:
        raise MeasureFailed(f"{mode}-mode clone failed: {err}") from None
    return out


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50 and p99 in milliseconds (p99 is the maximum below two samples). ValueError if empty."""
    if not samples:
        raise ValueError("no samples")
    p99 = max(samples) if len(samples) < 2 else statistics.quantiles(
        samples, n=100, method="inclusive")[98]
    return {"p50_ms": round(statistics.median(samples) * 1000, 3),
            "p99_ms": round(p99 * 1000, 3)}


def ratio(slow: float, fast: float) -> float:
    """``slow / fast`` rounded to 0.1 (inf when ``fast`` is zero)."""
    return round(slow / fast, 1) if fast > 0 else float("inf")
