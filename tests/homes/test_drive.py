"""drive: deliveries reach the core in order; refusals are reported, never fatal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.trust.grant import FiberSpec, VerifiedToken
from slurm_fiber.homes import GrantDir, GrantEvent, Home, Problem, drive
from tests.homes.homekit import FedHome, token, unverified_uid


class TokenRefused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = "invalid_token"


class RecordingCore:
    """The Admitter drive talks to, recording every call; refuses what names no UID."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_admit: set[str] = set()

    def verify(self, raw: bytes) -> VerifiedToken:
        uid = unverified_uid(raw)
        if uid is None:
            raise TokenRefused("signature does not verify")
        self.calls.append(("verify", uid))
        return VerifiedToken(uid, "iss", "j", ("aud",), 0.0, 0.0, None, FiberSpec(), raw)

    def lift(self, uid: str) -> bool:
        self.calls.append(("lift", uid))
        return False

    async def admit(self, vt: VerifiedToken) -> None:
        await asyncio.sleep(0)
        if vt.uid in self.fail_admit:
            raise RuntimeError("template warm failed: ImportError numpy")
        self.calls.append(("admit", vt.uid))

    async def remove(self, uid: str) -> None:
        await asyncio.sleep(0)
        self.calls.append(("remove", uid))


async def listed(events: list[GrantEvent]) -> AsyncIterator[GrantEvent]:
    for event in events:
        yield event


def fed(clock: FakeClock, events: list[GrantEvent] | None, fail: Exception | None = None):
    it = None if events is None else listed(events)
    return FedHome(SourceHealth(clock, 30.0), it, fail)


def test_a_fed_home_satisfies_the_home_protocol(clock: FakeClock) -> None:
    assert isinstance(fed(clock, []), Home)


def test_added_verifies_lifts_and_admits_removed_removes_in_order(clock: FakeClock) -> None:
    core = RecordingCore()
    problems: list[Problem] = []
    events = [GrantEvent.added(token("g1")), GrantEvent.removed("g1"),
              GrantEvent.added(token("g1", "j2"))]
    asyncio.run(drive(fed(clock, events), core, problems.append))
    assert core.calls == [
        ("verify", "g1"), ("lift", "g1"), ("admit", "g1"),
        ("remove", "g1"),
        ("verify", "g1"), ("lift", "g1"), ("admit", "g1"),
    ]
    assert problems == []


def test_refusals_are_reported_and_delivery_goes_on(clock: FakeClock) -> None:
    core = RecordingCore()
    core.fail_admit.add("warmfails")
    problems: list[Problem] = []
    events = [
        GrantEvent.added(b"not a token at all"),
        GrantEvent.added(token("warmfails")),
        GrantEvent.removed("../etc/passwd"),
        GrantEvent.added(token("ok")),
    ]
    asyncio.run(drive(fed(clock, events), core, problems.append))
    assert [p.code for p in problems] == ["invalid_token", "admit_failed", "bad_uid"]
    assert problems[0].reason == "signature does not verify"
    assert "ImportError" in problems[1].reason and problems[1].subject == "warmfails"
    assert ("admit", "ok") in core.calls


def test_a_home_that_delivers_nothing_returns_at_once(clock: FakeClock) -> None:
    core = RecordingCore()
    asyncio.run(asyncio.wait_for(drive(fed(clock, None), core), 5))
    assert core.calls == []


def test_a_home_whose_delivery_fails_is_reported(clock: FakeClock) -> None:
    problems: list[Problem] = []
    home = fed(clock, None, fail=PermissionError("grantdir refused"))
    asyncio.run(drive(home, RecordingCore(), problems.append))
    assert [(p.code, p.subject) for p in problems] == [("grants_failed", "fed")]


def test_drive_over_a_real_grantdir_until_cancelled(clock: FakeClock, tmp_path: Path) -> None:
    core = RecordingCore()
    grantdir = GrantDir(tmp_path, clock, interval=5.0, on_problem=lambda p: None)
    (tmp_path / "a.jwt").write_bytes(token("alpha"))

    class DirHome(FedHome):
        async def grants(self) -> AsyncIterator[GrantEvent]:
            return grantdir.events()

    async def main() -> None:
        task = asyncio.create_task(drive(DirHome(SourceHealth(clock, 30.0), None), core))
        await clock.settle()
        assert core.calls[-1] == ("admit", "alpha")
        (tmp_path / "a.jwt").unlink()
        await clock.advance_and_settle(5)
        assert core.calls[-1] == ("remove", "alpha")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_the_package_names_are_the_functions_whatever_was_imported_first() -> None:
    import subprocess
    import sys

    code = ("import slurm_fiber.daemon, slurm_fiber.homes.grantdir; "
            "import slurm_fiber.homes as h; "
            "print(callable(h.drive), h.Home.__name__, h.GrantDir.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["True", "Home", "GrantDir"]
