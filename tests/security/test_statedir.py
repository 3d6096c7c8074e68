"""fiberd trusts no directory another user can change (issue 13, item 4).

Attacks, each by the real job user ``mallory``: a state dir she pre-created,
a symlink of hers in place of the state dir, a state dir left world-writable
(umask 000), and her ``json.py`` / ``slurm_fiber`` package placed where a
root template would import it (its working directory, or a PYTHONPATH entry).
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from slurm_fiber.core.clock import SystemClock
from slurm_fiber.core.devices import DeviceChannel
from slurm_fiber.core.templates.parent import FiberRequest, Template, TemplateState, template_env
from slurm_fiber.core.trust.grant import TemplateSpec
from tests.cli.commandkit import BIN, env, flags
from tests.core.conftest import mark
from tests.core.processkit import REPO, aio
from tests.core.runtime.conftest import site
from tests.core.runtime.fiberdkit import Site
from tests.security.userkit import JobUser, as_user

__all__ = ["mark", "site"]


def wait_socket(proc: subprocess.Popen[str], sock: Path, within: float = 20.0) -> None:
    """Until ``sock`` exists (fiberd listens); fails if fiberd exits first."""
    end = time.monotonic() + within
    while not sock.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < end, "fiberd did not listen in time"
        time.sleep(0.05)


def run_fiberd(site: Site, state: Path, **kw: object) -> subprocess.CompletedProcess[str]:
    """fiberd on ``state``, expected to refuse at once (bounded by the timeout)."""
    return subprocess.run([str(BIN / "fiberd"), *flags(site, **{"state-dir": str(state)})],
                          env=env(), capture_output=True, text=True, timeout=60, **kw)


def assert_refused(out: subprocess.CompletedProcess[str], *words: str) -> None:
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("\n") == 1 + out.stderr.count("refusing to start"), out.stderr
    line = next(ln for ln in out.stderr.splitlines() if ln.startswith("fiberd: "))
    assert "Traceback" not in out.stderr
    for word in words:
        assert word in line, line


def test_a_state_dir_made_by_another_user_is_refused(site: Site, public: Path,
                                                     mallory: JobUser) -> None:
    state = public / "state"
    as_user(mallory, f"mkdir -m 0755 {state}")
    out = run_fiberd(site, state)
    assert_refused(out, f"unsafe state dir {state}", f"uid {mallory.uid}")
    assert os.listdir(state) == []  # nothing of fiberd's landed in her dir


def test_a_symlink_to_another_users_dir_is_refused(site: Site, public: Path,
                                                   mallory: JobUser) -> None:
    state = public / "state"
    as_user(mallory, f"mkdir -m 0777 {public}/hers && ln -s {public}/hers {state}")
    out = run_fiberd(site, state)
    assert_refused(out, f"{state} is a sym", f"owned by uid {mallory.uid}")
    assert os.listdir(public / "hers") == []
    # root's own link to her dir does not help: the target is checked as any path
    os.unlink(state)
    state.symlink_to(public / "hers")
    out = run_fiberd(site, state)
    assert_refused(out, f"{public}/hers", f"uid {mallory.uid}")


def test_a_world_writable_state_dir_is_refused_and_fiberd_makes_its_own_0700(
        site: Site, public: Path) -> None:
    loose = public / "loose"
    old = os.umask(0)
    try:
        loose.mkdir()  # as "mkdir" does under umask 000: mode 0777
    finally:
        os.umask(old)
    out = run_fiberd(site, loose)
    assert_refused(out, f"{loose} is writable by", "0777")

    fresh = site.root / "new" / "state"  # missing: fiberd creates it, under umask 000
    argv = [str(BIN / "fiberd"),
            *flags(site, **{"state-dir": str(fresh), "grantdir": str(site.grantdir)})]
    proc = subprocess.Popen(argv, env=env(), text=True, umask=0, stderr=subprocess.PIPE)
    try:
        wait_socket(proc, fresh / "fiberd.sock")
        for made in (site.root / "new", fresh):
            assert stat.S_IMODE(os.stat(made).st_mode) == 0o700, made
        assert stat.S_IMODE(os.stat(fresh / "audit.jsonl").st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(fresh / "fiberd.sock").st_mode) == 0o600
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, proc.communicate()[1]


PLANT = """import os
open({proof!r}, "w").write("imported as uid %d" % os.getuid())
"""


@pytest.mark.parametrize("where", ["cwd", "pythonpath"])
@aio
async def test_a_template_never_imports_from_a_dir_another_user_can_write(
        tmp_path: Path, public: Path, mallory: JobUser, mark: str, where: str) -> None:
    proof = tmp_path / "proof"  # root-only dir: only code run as root can write here
    hers = public / "hers"
    as_user(mallory, f"mkdir -m 0777 {hers} && mkdir {hers}/slurm_fiber && "
                     f"cat > {hers}/json.py <<'EOF'\n{PLANT.format(proof=str(proof))}EOF\n"
                     f"cp {hers}/json.py {hers}/slurm_fiber/__init__.py")
    pythonpath = str(REPO) if where == "cwd" else f"{hers}:{REPO}"
    state = hers if where == "cwd" else tmp_path / "state"
    state.mkdir(exist_ok=True)
    spec = TemplateSpec(preload=("json", "tests.core.templates.targetkit"),
                        env={"SF_TEST_MARK": mark, "PYTHONPATH": pythonpath})
    t = await Template.start("g1", spec, template_env(dict(os.environ), spec, DeviceChannel()),
                             None, state_dir=state, clock=SystemClock())
    try:
        assert await t.wait_warm() is TemplateState.READY, t.warm_error
        fiber = await t.fork(FiberRequest(id="f1", target="json:dumps", args=([1],)))
        ex = await fiber.wait()
        assert ex.result == {"ok": True, "result": "[1]"}
    finally:
        await t.stop(1.0)
    assert not proof.exists(), proof.read_text()
