"""Finding (issue 38, medium): the fibers of a root fiberd ran as root with every capability.

A fiber of a root standalone fiberd moved itself out of its grant's cgroups, lifted its
memory limit and device rules, and read the issuer's private key. Now a root fiberd
must be told whom fibers run as (``fiber_user``): they run as that unprivileged account,
without capabilities and with ``no_new_privs``; the only cgroup files the account may
write are the ``cgroup.procs`` of its own grant's groups.

The fiberd here is a real root process on this host's cgroups (hybrid: cgroup v2 for
processes, v1 for memory, pids and devices), run by the system interpreter, which the
fiber user can execute (a venv under /root it could not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.client.connection import FiberdClient
from tests.cli.commandkit import flags, wait_ready, wait_socket
from tests.core.processkit import UNIFIED, cgroup2_usable
from tests.core.runtime.fiberdkit import REPO, Site
from tests.security.userkit import JobUser

SYSTEM_PYTHON = "/usr/bin/python3"
SITE_PACKAGES = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" \
    / "site-packages"

# What the fiber tries, as hostile code would: each attempt's outcome, "ok" or the error.
ATTACK = textwrap.dedent("""
    import json, os, sys
    out = {}
    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except OSError as e:
            out[name] = e.strerror
    status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
    out["uid"] = int(status["Uid"].split()[0])
    out["cap_eff"] = status["CapEff"].strip()
    out["no_new_privs"] = status["NoNewPrivs"].strip()
    key = sys.argv[1]
    attempt("read_key", lambda: open(key).read())
    def write(path, value):
        with open(path, "w") as f:
            f.write(value)
    me = str(os.getpid())
    for line in open("/proc/self/cgroup").read().splitlines():
        _, ctrl, rel = line.split(":", 2)
        mount = "/sys/fs/cgroup/unified" if ctrl == "" else "/sys/fs/cgroup/" + ctrl.split(",")[0]
        if not os.path.isdir(mount + rel) or ctrl not in ("", "memory", "devices", "pids"):
            continue
        grant = mount + rel
        while "/grant-" in grant:
            grant = os.path.dirname(grant)
        carving = grant  # the carving root: the parent of grant-*
        name = ctrl or "v2"
        attempt(name + ":move_out", lambda: write(carving + "/cgroup.procs", me))
        attempt(name + ":move_to_top", lambda: write(mount + "/cgroup.procs", me))
        g = [d for d in os.listdir(carving) if d.startswith("grant-")][0]
        if ctrl == "memory":
            attempt("memory:lift_limit",
                    lambda: write(carving + "/" + g + "/memory.limit_in_bytes", "-1"))
        if ctrl == "pids":
            attempt("pids:lift_limit", lambda: write(carving + "/" + g + "/pids.max", "max"))
        if ctrl == "devices":
            attempt("devices:allow_all", lambda: write(mount + rel + "/devices.allow", "a"))
            attempt("devices:allow_all_grant",
                    lambda: write(carving + "/" + g + "/devices.allow", "a"))
    print(json.dumps(out))
""")


@pytest.fixture
def cgroup_dir() -> Iterator[Path]:
    if not cgroup2_usable():
        pytest.skip(f"no writable cgroup2 hierarchy at {UNIFIED}")
    root = UNIFIED / f"sf-test-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    yield root
    subprocess.run(["find", str(root), "-depth", "-type", "d", "-delete"], check=False)


def run_root_fiberd(site: Site, options: dict[str, str | None]) -> subprocess.Popen[str]:
    """A root ``fiberd`` for ``site``, run by the system interpreter on this checkout."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root",
           "PYTHONPATH": f"{REPO}:{SITE_PACKAGES}"}
    return subprocess.Popen(
        [SYSTEM_PYTHON, "-c", "from slurm_fiber.cli.fiberd import main; main()",
         *flags(site, **options)], env=env, text=True, start_new_session=True,
        stderr=subprocess.PIPE)


def test_hostile_root_fiberd_fiber_cannot_undo_confinement_or_read_keys(
    tmp_path: Path, mallory: JobUser, cgroup_dir: Path
) -> None:
    site = Site(tmp_path, uuid.uuid4().hex)
    tmp_path.chmod(0o755)  # the fiber user may reach the checkout, never fiberd's state
    key = tmp_path / "issuer.key"  # the issuer's private key, root's as a site keeps it
    key.write_text("-----BEGIN PRIVATE KEY-----\nsecret\n")
    key.chmod(0o600)
    site.drop(memory=256 << 20, pids=64)
    proc = run_root_fiberd(site, {"cgroup-root": str(cgroup_dir), "cgroup-backend": "auto",
                                  "fiber-user": mallory.name})
    try:
        sock = wait_socket(site, proc)
        wait_ready(sock)
        status = FiberdClient(sock).request("status")
        assert status["fiber_user"]["uid"] == mallory.uid, status  # type: ignore[index]
        read, write = os.pipe()
        with FiberdClient(sock) as client:
            client.clone(grant="g1", exec={"argv": [SYSTEM_PYTHON, "-c", ATTACK, str(key)]},
                         stdio={"stdout": write}, wait=True)
            os.close(write)
            end = client.wait_exit(within=30)
        with os.fdopen(read) as f:
            seen = json.loads(f.read())
        assert end["exit_code"] == 0, end
        assert seen["uid"] == mallory.uid, seen
        assert int(seen["cap_eff"], 16) == 0, seen
        assert seen["no_new_privs"] == "1", seen
        assert seen["read_key"] != "ok", seen
        attempts = {k: v for k, v in seen.items() if ":" in k}
        assert {"v2:move_out", "memory:lift_limit", "devices:allow_all"} <= set(attempts), seen
        assert all(v != "ok" for v in attempts.values()), attempts
        # Output files still land where they always did (fiberd opens them for the fiber).
        with FiberdClient(sock) as client:
            fiber = client.clone(grant="g1", exec={"argv": ["sh", "-c", "echo hello; id -u"]},
                                 wait=True)
            client.wait_exit(within=30)
        out = site.state / "fibers" / f"fiber-{fiber['id']}.out"
        assert out.read_text().split() == ["hello", str(mallory.uid)]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_root_fiberd_without_fiber_user_refuses_to_start(tmp_path: Path,
                                                        mallory: JobUser) -> None:
    site = Site(tmp_path, uuid.uuid4().hex)
    proc = run_root_fiberd(site, {"fiber-user": "none"})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "a root fiberd needs fiber_user" in err, err
