"""Limits and devices the kernel enforces: real fiberd processes, real fibers, real cgroups.

On a hybrid host (cgroup v1 controllers, a cgroup2 tree without them) fiberd's
``hybrid`` backend writes memory, pids and cpu limits and the device rule in
the v1 hierarchies, and keeps stop and emptiness in the v2 tree; ``v1`` keeps
all of it in v1 (freezer for stop). Each test runs on whichever of those this
host has; there is no skip for a missing controller on a host that has it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.client.connection import FiberdClient
from slurm_fiber.core.cgroups.v1 import V1Layout
from tests.cli.commandkit import fiberd, wait_ready, wait_socket
from tests.core.processkit import UNIFIED, cgroup2_usable, v1_usable
from tests.core.runtime.fiberdkit import Site

LAYOUT = V1Layout.of_self()
HOST_BACKENDS = [b for b, ok in (("hybrid", cgroup2_usable() and v1_usable("memory")),
                                 ("v1", v1_usable("freezer"))) if ok]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="v1 cgroups are root's")
PYTHON = sys.executable


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path, uuid.uuid4().hex)


@pytest.fixture(params=HOST_BACKENDS or ["none"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "none":
        pytest.fail(f"this host has neither a v1 freezer nor cgroup v1 memory with a "
                    f"writable {UNIFIED}")
    return str(request.param)


@contextlib.contextmanager
def serving(site: Site, backend: str, log: Path | None = None,
            **options: str) -> Iterator[Path]:
    """A ready fiberd on ``backend`` (carving a delegated root) for ``site``'s grants; its
    log (stderr) goes to ``log`` when given."""
    flags: dict[str, str | None] = {"cgroup-root": "delegate", "cgroup-backend": backend,
                                    **options}
    with contextlib.ExitStack() as stack:
        stderr = stack.enter_context(log.open("w")) if log else subprocess.DEVNULL
        proc = stack.enter_context(fiberd(site, flags, stderr=stderr))
        path = wait_socket(site, proc)
        wait_ready(path)
        end = time.monotonic() + 30
        while True:  # every grant's template warm, not only the first
            with FiberdClient(path) as client:
                status = client.request("status")
            states = status["templates"].values()  # type: ignore[union-attr]
            if all(state == "ready" for state in states) or time.monotonic() > end:
                break
            time.sleep(0.05)
        assert status["cgroups"]["backend"] == backend, status["cgroups"]  # type: ignore[index]
        yield path
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    # A clean stop leaves none of its groups in any hierarchy.
    name = f"slurm-fiber.{proc.pid}"
    left = [c for c in LAYOUT.mounts if c in ("memory", "pids", "cpu", "devices", "freezer")
            and (root := LAYOUT.root(c, name)) is not None and root.exists()]
    assert not left, left


def run(sock: Path, grant: str, code: str, *args: str) -> dict[str, object]:
    """Run ``python -c code args`` as a fiber of ``grant``; its exit event."""
    with FiberdClient(sock) as client:
        client.clone(grant=grant, wait=True, exec={"argv": [PYTHON, "-c", code, *args]})
        return client.wait_exit(within=60)


HOG = "b = b'x' * (512 << 20)"  # touches every page: far over a 96 MiB limit


@needs_root
def test_a_fiber_over_its_memory_limit_is_oom_killed_and_its_exit_says_so(
        site: Site, backend: str) -> None:
    site.drop(memory=96 << 20)
    with serving(site, backend) as sock:
        end = run(sock, "g1", HOG)
        calm = run(sock, "g1", "b = b'x' * (8 << 20)")
    assert end["signal"] == 9, end
    assert end["rusage"]["oom_kills"] >= 1, end  # type: ignore[index]
    assert end["reason"]["code"] == "oom", end  # type: ignore[index]
    assert calm["exit_code"] == 0 and calm["reason"] is None, calm
    assert calm["exit_code"] == 0 and calm["rusage"]["oom_kills"] == 0, calm  # type: ignore[index]


@needs_root
def test_an_ended_fibers_leaf_serves_again_with_its_memory_peak_renewed(
        site: Site, backend: str) -> None:
    # On v1 memory a leaf is reused once its peak is reset (cgroups.renew_memory): a
    # Clone makes and removes no cgroup, and a fiber after a big one reports its own peak.
    # (No spares: each exec fiber is spawned into the leaf the one before it left free.)
    site.drop(memory=512 << 20)
    log = site.root / "fiberd.log"
    with serving(site, backend, log, spares="0", **{"log-level": "debug"}) as sock, \
            FiberdClient(sock) as client:
        def clone(code: str) -> tuple[str, dict[str, object]]:
            fiber = client.clone(grant="g1", wait=True, exec={"argv": [PYTHON, "-c", code]})
            return str(fiber["cgroup"]), client.wait_exit(within=60)

        big_leaf, big = clone("b = b'x' * (64 << 20)")
        after = [clone("pass") for _ in range(4)]
    assert big["rusage"]["memory_peak"] >= 64 << 20, big  # type: ignore[index]
    removed = [line for line in log.read_text().splitlines() if "removed:" in line]
    assert big_leaf in [leaf for leaf, _ in after], (big_leaf, removed)
    for _, end in after:
        assert end["exit_code"] == 0 and end["rusage"]["memory_peak"] < 32 << 20, end  # type: ignore[index]


BOMB = """
import errno, os, sys
r, w = os.pipe()
n = 0
while n < 1000:
    try:
        pid = os.fork()
    except OSError as e:
        sys.exit(n if e.errno == errno.EAGAIN else 250)
    if pid == 0:
        os.close(w)
        os.read(r, 1)  # until the parent exits
        os._exit(0)
    n += 1
sys.exit(251)
"""


@needs_root
def test_a_fork_bomb_stops_at_the_pids_limit(site: Site, backend: str) -> None:
    site.drop(pids=16)
    with serving(site, backend) as sock:
        end = run(sock, "g1", BOMB)
    # The template, its spare and the fiber itself count toward the grant's 16.
    assert end["exit_code"] is not None and 0 < end["exit_code"] < 16, end  # type: ignore[operator]


SPIN = """
import sys, time
end = time.monotonic() + 1.0
while time.monotonic() < end:
    pass
sys.exit(round(100 * time.process_time()))
"""


def groups(text: str) -> dict[str, str]:
    """A /proc/<pid>/cgroup text as hierarchy -> group."""
    return {hierarchy: group for _, hierarchy, group in
            (line.split(":", 2) for line in text.splitlines())}


@needs_root
def test_fibers_stay_in_their_templates_cpu_group_and_the_grants_quota_binds_them(
        site: Site, backend: str, tmp_path: Path) -> None:
    # In the v1 cpu hierarchy a fiber, spawned or forked from a spare, stays in its
    # template's group (cgroups.mirrors); memory, pids and devices give it its own leaf.
    site.drop(cpu=0.2)
    seen = tmp_path / "spawned"
    copy = "import shutil, sys; shutil.copy('/proc/self/cgroup', sys.argv[1])"
    with serving(site, backend) as sock, FiberdClient(sock) as client:
        assert run(sock, "g1", copy, str(seen))["exit_code"] == 0
        client.clone(grant="g1", wait=True,
                     call={"target": "tests.core.runtime.targetkit:cgroups"})
        called = client.wait_exit(within=60)
        spun = run(sock, "g1", SPIN)
    spawned, forked = groups(seen.read_text()), groups(str(called["result"]))
    assert spawned["cpu"] == forked["cpu"] and spawned["cpu"].endswith("/template"), spawned
    for hierarchy in ("memory", "pids", "devices"):
        assert "/fibers/" in spawned[hierarchy] and "/fibers/" in forked[hierarchy]
    assert spawned["memory"] != forked["memory"]
    # The quota, 0.2 CPU on the grant's group, holds a second of spinning to about 0.2 s.
    assert spun["exit_code"] is not None and 5 <= spun["exit_code"] <= 40, spun  # type: ignore[operator]


OPEN = """
import os, sys
try:
    os.close(os.open(sys.argv[1], os.O_RDWR))
except OSError as e:
    sys.exit(e.errno)
"""


@pytest.fixture
def fake_gpu(tmp_path: Path) -> Path:
    """A character device node with the NVIDIA major (195) and no driver behind it."""
    node = tmp_path / "dev" / "nvidia-fake"
    node.parent.mkdir()
    os.mknod(node, 0o666 | 0o020000, os.makedev(195, random.randrange(16, 200)))
    return node


@needs_root
def test_a_grant_without_the_gpu_cannot_open_its_node_and_one_with_it_can(
        site: Site, backend: str, fake_gpu: Path) -> None:
    site.drop("with", devices=("gpu",))
    site.drop("without")
    with serving(site, backend, devices=f"gpu:0:{fake_gpu}") as sock:
        with FiberdClient(sock) as client:
            grants = {g["uid"]: g for g in client.request("list_grants")["grants"]}  # type: ignore[union-attr]
        for uid in ("with", "without"):
            devices = grants[uid]["enforcement"]["devices"]
            assert devices["confined_by"] == "cgroup v1 devices", devices
        assert "c 195:" in grants["with"]["enforcement"]["devices"]["reason"]
        # The cgroup denies it: EPERM. Allowed, the open reaches the (absent) driver: ENXIO.
        assert run(sock, "without", OPEN, str(fake_gpu))["exit_code"] == errno.EPERM
        assert run(sock, "with", OPEN, str(fake_gpu))["exit_code"] in (0, errno.ENXIO,
                                                                      errno.ENODEV)
        for pseudo in ("/dev/null", "/dev/zero", "/dev/urandom"):
            assert run(sock, "without", OPEN, pseudo)["exit_code"] == 0, pseudo


def test_a_stopped_fiber_takes_what_it_forked_with_it(site: Site, backend: str) -> None:
    """Stop (SIGTERM, then the group's SIGKILL after ``grace``) reaches a child that ignores
    SIGTERM: ``cgroup.kill`` in hybrid, freeze-kill-thaw in the v1 freezer."""
    site.drop()
    mark = f"sf-stop-{uuid.uuid4().hex[:8]}"
    # The sleeps ignore TERM too; one leaves the process group: only the cgroup reaches it.
    script = "trap '' TERM; setsid sleep 300 & sleep 300; wait"
    with serving(site, backend) as sock, FiberdClient(sock) as client:
        fiber = client.clone(grant="g1", wait=True, exec={"argv": ["sh", "-c", script]},
                             env={"SF_MARK": mark})
        end = time.monotonic() + 10
        while len(marked(mark)) < 3 and time.monotonic() < end:  # sh and its two sleeps
            time.sleep(0.05)
        assert len(marked(mark)) == 3
        with FiberdClient(sock) as other:
            other.request("stop_fiber", fiber=fiber["id"], grace=0.2)
        assert client.wait_exit(within=30)["signal"] is not None
        assert marked(mark) == []


def marked(mark: str) -> list[int]:
    """Live processes whose environment holds ``SF_MARK=mark``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if f"SF_MARK={mark}".encode() in environ and state != "Z":
            found.append(int(pid))
    return found
