"""Exec fibers spawned straight into their leaf get what one forked from a spare gets.

Each test runs once per start (``EXEC_STARTS``): "forked" (from a spare of the
template) and "spawned" (core/exec_spawn.py: no spare is taken). The same
expectations hold for both: env (the template's, the order's, SLURM_FIBER_ID; the
devices' variables win), cwd, cgroup leaf, stdio (passed fds and output files),
process group, signal mask and dispositions, parent, exit and reasons. The death
signal differs, as core/exec_spawn.py says: a spawned program has none, and fiberd
kills it when its template is lost. A program that cannot start as ordered starts
from a spare after all, and fails as it always has. fiberd spawns while cgroup moves
are cheap and hands an idle spare the Clone that comes after a pause.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.cgroups.v1 import mirrors
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.devices import Device, DeviceChannel
from slurm_fiber.core.fibers.fiber import FiberState
from slurm_fiber.core.templates.parent import FiberRequest
from slurm_fiber.core.trust.grant import Limits
from tests.core.processkit import (
    EXEC_STARTS,
    aio,
    exec_template,
    fork_as,
    idle_spares,
    marked_procs,
    read_line,
    stop_on_fake_clock,
    wait_marked,
    warm_template,
)

# Prints, as JSON, what an exec'd program inherits: its env, cwd, process group, parent,
# death signal, cgroup and open descriptors (the listing's own among them).
PROBE = """
import os
fds = {}  # listed first: what the exec'd program was given, before it opens anything
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own, closed by now
        fds[fd] = "(the listing)"
import ctypes, json, signal
sig = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
print(json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "ppid": os.getppid(),
                  "leads_group": os.getpgid(0) == os.getpid(), "deathsig": sig.value,
                  "cgroup": open("/proc/self/cgroup").read(),
                  "fds": fds}))
"""


def status_masks(text: str) -> dict[str, int]:
    """SigBlk, SigIgn and SigCgt of a /proc/<pid>/status text."""
    fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
    return {k: int(fields[k], 16) for k in ("SigBlk", "SigIgn", "SigCgt")}


def proc_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if e)


@pytest.mark.parametrize("carved", [False, True])
@pytest.mark.parametrize("start", EXEC_STARTS)
@aio
async def test_an_exec_fiber_inherits_env_devices_cwd_cgroup_group_and_death_signal(
        tmp_path: Path, mark: str, request: pytest.FixtureRequest, start: str,
        carved: bool) -> None:
    root = request.getfixturevalue("cgroup_root") if carved else None
    grant = CgroupManager(root).carve_grant("g", Limits())
    channel = DeviceChannel.of([Device("gpu", 0), Device("gpu", 2, uuid="GPU-2")])
    t = await exec_template(tmp_path, mark, start, cgroup=grant, channel=channel)
    fiber = await fork_as(t, start, FiberRequest(
        id="probe", mode="exec", argv=(sys.executable, "-c", PROBE), cwd=str(tmp_path),
        env={"EXTRA": "yes", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}))
    assert (await fiber.wait()).exit_code == 0
    assert fiber.stdout_path is not None
    seen = json.loads(fiber.stdout_path.read_text())
    assert seen["env"] == {**proc_env(t.pid), "EXTRA": "yes", "SLURM_FIBER_ID": "probe"}
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == channel.env()["CUDA_VISIBLE_DEVICES"]
    assert seen["cwd"] == str(tmp_path)
    # stdio and the listing's own: nothing leaked
    assert sorted(int(fd) for fd in seen["fds"]) == [0, 1, 2, 3], seen["fds"]
    assert (seen["ppid"], seen["leads_group"], seen["deathsig"]) == (
        t.pid, True, signal.SIGKILL if start == "forked" else 0)
    if carved:
        assert fiber.cgroup is not None and root is not None
        lines = seen["cgroup"].splitlines()
        assert f"0::/{fiber.cgroup.relative_to(root.parent)}" in lines
        for mirror in mirrors(fiber.cgroup):  # the v1 hierarchies (limits, devices)
            assert any(line.endswith(":/" + "/".join(mirror.parts[5:])) for line in lines)
    else:
        assert seen["cgroup"] == Path(f"/proc/{t.pid}/cgroup").read_text()
    await t.stop(1.0)
    assert marked_procs(mark) == []


@pytest.mark.parametrize("start", EXEC_STARTS)
@aio
async def test_an_exec_fiber_starts_with_signals_unblocked_and_at_default(
        tmp_path: Path, mark: str, start: str) -> None:
    t = await exec_template(tmp_path, mark, start)
    fiber = await fork_as(t, start, FiberRequest(id="st", mode="exec",
                                                 argv=("cat", "/proc/self/status")))
    assert (await fiber.wait()).exit_code == 0
    assert fiber.stdout_path is not None
    masks = status_masks(fiber.stdout_path.read_text())
    # What this process ignores but Python's own (SIGPIPE, SIGXFSZ), which a subprocess
    # gets back at default, the template and its fibers inherit.
    ours = status_masks(Path("/proc/self/status").read_text())["SigIgn"]
    python_own = (1 << (signal.SIGPIPE - 1)) | (1 << (signal.SIGXFSZ - 1))
    assert masks == {"SigBlk": 0, "SigIgn": ours & ~python_own, "SigCgt": 0}
    await t.stop(1.0)


@pytest.mark.parametrize("start", EXEC_STARTS)
@aio
async def test_an_exec_fiber_takes_passed_stdio_and_reports_its_exit(
        tmp_path: Path, mark: str, start: str) -> None:
    t = await exec_template(tmp_path, mark, start)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    fiber = await fork_as(t, start, FiberRequest(
        id="io", mode="exec", argv=("sh", "-c", "read x; echo $x-$SLURM_FIBER_ID; exit 5"),
        stdio=(in_r, out_w, None)))
    os.close(in_r)
    os.close(out_w)
    os.write(in_w, b"hello\n")
    assert await read_line(out_r) == b"hello-io\n"
    os.close(in_w)
    os.close(out_r)
    end = await fiber.wait()
    assert (end.exit_code, end.result, fiber.stdout_path) == (5, None, None)
    assert fiber.stderr_path is not None and fiber.stderr_path.read_text() == ""
    await t.stop(1.0)


@aio
async def test_a_killed_template_takes_its_spawned_programs_with_it(
        tmp_path: Path, mark: str, cgroup_root: Path) -> None:
    clock = FakeClock()  # no re-warm meanwhile: what is left is what survived
    grant = CgroupManager(cgroup_root).carve_grant("g", Limits())
    t = await exec_template(tmp_path, mark, "spawned", clock=clock, cgroup=grant)
    fiber = await fork_as(t, "spawned", FiberRequest(id="long", mode="exec",
                                                     argv=("sleep", "60")))
    os.kill(t.pid, signal.SIGKILL)
    end = await fiber.wait()  # no death signal: fiberd killed it
    assert end.state is FiberState.LOST and end.reason is not None
    assert end.reason.code == "template_lost"
    assert wait_marked(mark, 0) == []
    await stop_on_fake_clock(t, clock)


@pytest.mark.parametrize("carved", [False, True])
@aio
async def test_the_template_is_back_in_its_own_groups_after_each_spawn(
        tmp_path: Path, mark: str, request: pytest.FixtureRequest, carved: bool) -> None:
    root = request.getfixturevalue("cgroup_root") if carved else None
    grant = CgroupManager(root).carve_grant("g", Limits())
    t = await exec_template(tmp_path, mark, "spawned", cgroup=grant)
    own = Path(f"/proc/{t.pid}/cgroup").read_text()
    for i in range(3):
        fiber = await fork_as(t, "spawned", FiberRequest(id=f"x{i}", mode="exec",
                                                         argv=("true",)))
        assert (await fiber.wait()).exit_code == 0
        assert Path(f"/proc/{t.pid}/cgroup").read_text() == own
    await t.stop(1.0)
    assert marked_procs(mark) == []


# Run in a child of the test (it moves itself): joins through kept descriptors, a group
# removed and made again by the same name, the bound on what is kept, a refusal, close.
DOORS = """
import os, sys
from slurm_fiber.core.templates.child.exec_spawn import move
from slurm_fiber.core.cgroups.held_files import HeldFiles
root = sys.argv[1]
home, a, b = (f"{root}/{n}" for n in ("home", "a", "b"))
def where():
    return open("/proc/self/cgroup").read().split("::")[-1].strip()
def kept():
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own, closed by now
            pass
    return sorted(t for t in found if t.endswith("cgroup.procs"))
doors = HeldFiles(groups=2)
move(doors, {"cgroup": a}); assert where().endswith("/a"), where()
move(doors, {"cgroup": home}); assert where().endswith("/home")
os.rmdir(a); os.mkdir(a)  # a leaf removed, then made again by the same name
move(doors, {"cgroup": a}); assert where().endswith("/a"), where()
move(doors, {"cgroup": b}); move(doors, {"cgroup": home})
assert kept() == [f"{b}/cgroup.procs", f"{home}/cgroup.procs"], kept()
try:
    move(doors, {"cgroup": f"{root}/gone"})
except OSError as e:
    assert f"{root}/gone" in str(e) and where().endswith("/home"), e
else:
    raise AssertionError("joined a group that does not exist")
doors.close(); assert kept() == []
print("ok")
"""


def test_a_template_moves_through_kept_descriptors_reopened_when_their_group_is_made_again(
        cgroup_root: Path) -> None:
    for name in ("home", "a", "b"):
        (cgroup_root / name).mkdir()
    child = subprocess.run(
        [sys.executable, "-c", f"open('{cgroup_root}/home/cgroup.procs', 'w').write('0')\n"
         + DOORS, str(cgroup_root)], capture_output=True, text=True, timeout=30)
    assert child.stdout.strip() == "ok", child.stderr


@aio
async def test_a_program_that_cannot_start_as_ordered_fails_from_a_spare_as_before(
        tmp_path: Path, mark: str) -> None:
    t = await exec_template(tmp_path, mark, "spawned")
    missing = await t.fork(FiberRequest(id="nf", mode="exec", argv=("no-such-program-sf",)))
    end = await missing.wait()
    assert end.exit_code == 127 and end.result is not None
    assert end.result["exec_failed"]["name"] == "ENOENT"
    nowhere = await t.fork(FiberRequest(id="cwd", mode="exec", argv=("true",),
                                        cwd=str(tmp_path / "gone")))
    end = await nowhere.wait()
    assert end.exit_code == 72 and end.result is not None
    assert "gone" in end.result["error"]["message"]
    ran = await fork_as(t, "spawned", FiberRequest(id="ok", mode="exec", argv=("true",)))
    assert (await ran.wait()).exit_code == 0  # and the next one is spawned again
    await t.stop(1.0)
    assert marked_procs(mark) == []


@aio
async def test_an_exec_clone_is_spawned_while_moves_are_cheap_and_takes_a_spare_after_a_pause(
        tmp_path: Path, mark: str) -> None:
    # fiberd's rule (exec_spawn="hot", core/templates.py): a cgroup move after a pause waits
    # for an RCU grace period, so a Clone after one takes the idle spare, already placed.
    clock = FakeClock()
    t = await warm_template(tmp_path, mark, clock=clock)
    [spare] = await idle_spares(t)
    await clock.advance_and_settle(1.0)  # a pause since the spare moved
    paused = await t.fork(FiberRequest(id="a", mode="exec", argv=("true",)))
    assert paused.pid == spare and (await paused.wait()).exit_code == 0
    [spare] = await idle_spares(t)  # its replacement has just moved: moves are cheap
    burst = await t.fork(FiberRequest(id="b", mode="exec", argv=("true",)))
    assert burst.pid != spare and (await burst.wait()).exit_code == 0
    assert t.idle_spares == [spare]
    await clock.advance_and_settle(1.0)
    later = await t.fork(FiberRequest(id="c", mode="exec", argv=("true",)))
    assert later.pid == spare and (await later.wait()).exit_code == 0
    await stop_on_fake_clock(t, clock)
    assert marked_procs(mark) == []
