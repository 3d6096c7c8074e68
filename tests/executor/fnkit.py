"""Functions the executor tests run by reference (importable in the template as
``tests.executor.fnkit``: the checkout is on the venv's path)."""

from __future__ import annotations

import os
import time
from pathlib import Path


class Boom(ValueError):
    """A user exception the caller gets back as itself."""


def square(x: int) -> int:
    return x * x


def describe(*args: object, **kwargs: object) -> tuple[object, ...]:
    return (args, kwargs, os.getpid())


def fail(message: str) -> None:
    raise Boom(message)


def sleep_then(seconds: float, pid_file: str | None = None, value: object = None) -> object:
    if pid_file:
        Path(pid_file).write_text(str(os.getpid()))
    time.sleep(seconds)
    return value


def die_by(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(10)


def shout(word: str) -> str:
    return word.upper()


def echo_and_fail(word: str) -> str:
    print(f"printed {word}")
    if word == "bad":
        raise ValueError(f"no {word}")
    return word


def span(seconds: float) -> tuple[float, float]:
    """When this call ran, on the host's CLOCK_MONOTONIC (every fiber's clock alike)."""
    start = time.monotonic()
    time.sleep(seconds)
    return start, time.monotonic()


def gated(gate: str, started: str, value: object = None) -> object:
    """Say it started (``started`` written), then wait, at most 120 s, for ``gate``."""
    Path(started).write_text(str(os.getpid()))
    for _ in range(12_000):
        if Path(gate).exists():
            break
        time.sleep(0.01)
    return value
