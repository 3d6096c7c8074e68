"""What grant-conform's templates preload and its fibers run.

Every conformance grant's template imports this module (``preload``) and
calls ``warm`` once before it reports ready, so a fiber can tell whether it
was forked from a warm template (``warmed``). The other functions let a
clause see a fiber's environment or keep one running until it is stopped.
Nothing here is for production use.
"""

from __future__ import annotations

import os
import time

_state = {"warmed_in": 0}


def warm() -> None:
    """The template's warm hook: records the pid that warmed this interpreter."""
    _state["warmed_in"] = os.getpid()


def warmed() -> bool:
    """Whether this interpreter was warmed by an ancestor (the template), not by itself."""
    return _state["warmed_in"] not in (0, os.getpid())


def environment(names: list[str]) -> dict[str, str | None]:
    """The values of ``names`` in this fiber's environment (None when unset)."""
    return {name: os.environ.get(name) for name in names}


def sleep(seconds: float) -> str:
    """Sleep, so a clause can watch a running fiber being stopped."""
    time.sleep(seconds)
    return "slept"
