"""How a template's work fails: the errors the runtime sees, and those its parts pass each other.

``TemplateNotReady`` (a fork asked of a template that is not ready, also one that died,
stopped answering or was stopped meanwhile: the runtime answers the retryable ``cold``)
and ``ForkFailed`` (the fiber could not be started: one line, and the errno of the
cause when it was an OSError) reach the runtime. ``NoAnswer``, ``SpareGone`` and
``SpawnRefused`` stay inside the template's parts: ``fork`` turns each into one of the
first two, or into a retry with a spare made on the spot.
"""

from __future__ import annotations

from slurm_fiber.core.templates.lifecycle import TemplateState, WarmError


class TemplateNotReady(Exception):
    """``fork`` on a template that is not ready; ``state`` (and ``warm_error``) say why."""

    def __init__(self, state: TemplateState, warm_error: WarmError | None) -> None:
        self.state = state
        self.warm_error = warm_error
        detail = f": {warm_error.error}: {warm_error.message}" if warm_error else ""
        super().__init__(f"template is {state.value}{detail}")


class ForkFailed(Exception):
    """The template could not start the fiber (one-line reason; ``errno`` the cause's,
    when an OSError was: EMFILE/ENFILE make the Clone's answer ``busy``)."""

    def __init__(self, reason: str, errno: int | None = None) -> None:
        super().__init__(reason)
        self.errno = errno


class SpareGone(Exception):
    """The spare died before it took its order (one line)."""


class SpawnRefused(Exception):
    """The template could not start an exec fiber's program straight into a leaf (one
    line): a forked spare will run it and say why."""


class NoAnswer(ForkFailed):
    """The template cannot serve a spare request: it is gone, stopped answering or is
    stopping (it is no longer ready; ``fork`` turns this into TemplateNotReady)."""
