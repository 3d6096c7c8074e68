"""Exec fibers started from an exec stub get exactly what one forked from the template gets.

Each test runs once per start (``EXEC_STARTS``): "forked" (no exec stubs, today's
path) and "stub" (an idle exec stub is waiting, and the fiber is checked to be it).
The same expectations hold for both: env (the template's, the order's, SLURM_FIBER_ID;
the devices' variables win), cwd, cgroup leaf, stdio (passed fds and output files),
process group, signal mask and dispositions, death signal, parent, exit and reasons.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups import CgroupManager, mirrors
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.devices import Device, DeviceChannel
from slurm_fiber.core.fibers import FiberState
from slurm_fiber.core.grant import Limits
from slurm_fiber.core.templates import FiberRequest
from tests.core.processkit import (
    EXEC_STARTS,
    aio,
    exec_template,
    fork_as,
    idle_spares,
    idle_stub,
    marked_procs,
    read_line,
    stop_on_fake_clock,
    stub_makers,
    wait_marked,
    warm_template,
)

T = "tests.core.templates.targetkit"

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
        t.pid, True, signal.SIGKILL)
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


@aio
async def test_the_makers_own_bind_now_stays_its_own_and_a_templates_is_kept(
        tmp_path: Path, mark: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The maker runs with LD_BIND_NOW=1 (core/exec_stub.py); without it in the template's
    # env, a program never sees it (the env test above); with it, it keeps its value.
    monkeypatch.setenv("LD_BIND_NOW", "kept")
    t = await exec_template(tmp_path, mark, "stub")
    fiber = await fork_as(t, "stub", FiberRequest(
        id="probe", mode="exec", argv=(sys.executable, "-c", PROBE), cwd=str(tmp_path)))
    assert (await fiber.wait()).exit_code == 0
    assert fiber.stdout_path is not None
    seen = json.loads(fiber.stdout_path.read_text())
    assert seen["env"]["LD_BIND_NOW"] == "kept"
    assert seen["env"] == {**proc_env(t.pid), "SLURM_FIBER_ID": "probe"}
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
async def test_a_killed_template_takes_its_stubs_their_fibers_and_the_maker_with_it(
        tmp_path: Path, mark: str) -> None:
    clock = FakeClock()  # no re-warm meanwhile: what is left is what survived
    t = await exec_template(tmp_path, mark, "stub", clock=clock)
    fiber = await fork_as(t, "stub", FiberRequest(id="long", mode="exec",
                                                  argv=("sleep", "60")))
    await idle_stub(t)  # the one made to replace it
    assert len(stub_makers(marked_procs(mark))) == 2  # the maker and the idle stub
    os.kill(t.pid, signal.SIGKILL)
    end = await fiber.wait()
    assert end.state is FiberState.LOST and end.reason is not None
    assert end.reason.code == "template_lost"
    assert wait_marked(mark, 0) == []  # all by their death signal
    await stop_on_fake_clock(t, clock)


@aio
async def test_stubs_are_kept_from_the_first_exec_fiber_on(tmp_path: Path, mark: str) -> None:
    t = await warm_template(tmp_path, mark, preload=(T,), exec_stubs=1)
    call = await t.fork(FiberRequest(id="c", target=f"{T}:add", args=(1, 2)))
    assert (await call.wait()).exit_code == 0
    await idle_spares(t)
    assert t.idle_stubs == [] and stub_makers(marked_procs(mark)) == []  # call-only: none
    first = await t.fork(FiberRequest(id="x", mode="exec", argv=("true",)))
    assert first.pid not in t.idle_stubs and (await first.wait()).exit_code == 0
    stub = await idle_stub(t)
    assert (await fork_as(t, "stub", FiberRequest(id="y", mode="exec", argv=("true",)))).pid \
        == stub
    await t.stop(1.0)
    assert marked_procs(mark) == []
