"""ReadyGate: the one readiness fact a control plane wants, published in order.

The gate tracks which grants have a warm template and publishes "any
template is warm" through ``publish``, on the first ``publish_ready`` and
whenever that fact flips. One publish is in flight at a time and no lock is
held across it: a ``publish_ready`` arriving meanwhile records its change and
returns, and the publisher in flight sends the newest state once its call
returns, so the control plane sees states in the order they were decided,
never an older state after a newer one. A failed or cancelled publish
leaves the published state unknown (the plane may have taken it or not),
so the next ``publish_ready`` or ``republish`` sends the current state
whatever it is. The gate does not log; ``republish`` reports whether the
outcome changed so the home logs each distinct failure, and the recovery,
once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from slurm_fiber.homes.healthpoll import error_message

Publish = Callable[[list[str]], Awaitable[None]]

_NEVER = object()  # outcome before any publish returned


class ReadyGate:
    """Readiness of one home's grants. Used on one event loop; no method holds a lock.

    ``publish(warm)`` sends the gate: ``warm`` holds the UIDs of the grants
    with a warm template, sorted, empty when none has. It raises on failure.
    """

    def __init__(self, publish: Publish) -> None:
        self._publish = publish
        self._warm: set[str] = set()
        self._touched = False
        self._published: bool | None = None  # the fact the control plane last accepted
        self._in_flight = False
        self._outcome: object = _NEVER  # None (sent) or the last error's message

    def ready(self) -> bool:
        """Whether any grant has a warm template (the newest decided state)."""
        return bool(self._warm)

    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        """Record that ``grant_uid``'s template is warm, or no longer is, and publish a flip.

        Blocks for the publish when this call sends it. Returns without
        sending when nothing had to be sent or another publish in flight
        will send it. Raises the publish error of the last state this call
        sent; the state stays unpublished for a later call to send.
        """
        first = not self._touched
        self._touched = True
        if ready:
            self._warm.add(grant_uid)
        else:
            self._warm.discard(grant_uid)
        if self._in_flight or (not first and self.ready() == self._published):
            return
        err = await self._send()
        if err is not None:
            raise err

    async def republish(self) -> tuple[bool, Exception | None]:
        """Send the gate again when the last publish failed or it was never accepted.

        Before the first ``publish_ready`` there is nothing to republish, and
        while a publish is in flight that one sends the newest state: both
        return ``(False, None)``. ``changed`` is True when the outcome differs
        from the previous one (a new error message, or a success after a
        failure); ``err`` is this send's error. Never raises a publish error.
        """
        if not self._touched or self._in_flight:
            return False, None
        if self._outcome is None and self.ready() == self._published:
            return False, None
        before = self._outcome
        err = await self._send()
        return self._outcome != before, err

    async def _send(self) -> Exception | None:
        """Publish the newest state until what was sent is still the newest decided."""
        self._in_flight = True
        try:
            while True:
                fact = self.ready()
                err = await self._publish_once(sorted(self._warm))
                # A failed send may still have reached the plane: its state is unknown.
                self._published = fact if err is None else None
                if self.ready() == fact:
                    return err
        except BaseException:
            self._published = None  # cancelled mid-send: the plane may hold either state
            raise
        finally:
            self._in_flight = False

    async def _publish_once(self, warm: list[str]) -> Exception | None:
        try:
            await self._publish(warm)
        except Exception as err:
            self._outcome = error_message(err)
            return err
        self._outcome = None
        return None
