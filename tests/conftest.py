"""Project-wide test set-up, and the fixtures several test dirs share.

In CI (``CI=true``) a skipped test fails the run unless it is marked
``machine_may_lack``: nothing an issue asks for may be skipped there, only
what this kind of machine truly lacks (e.g. enforceable cgroup limits).

Shared fixtures: ``clock``; ``served`` (the socket API's process-backed test service, for
tests/core/api and fiberctl's tests in tests/cli); the bare-host Slurm cluster and its job
users (tests/barehost/clusterkit.py says how), for the cluster tests in tests/barehost,
tests/homes/slurm, tests/prolog, tests/cli, tests/conform and tests/security.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.common import wait_empty
from slurm_fiber.core.cgroups.groups import kill, remove_tree
from slurm_fiber.core.clock import FakeClock, SystemClock
from tests.barehost.clusterkit import BareHost, SlurmCluster, bare_host, exports, new_job_dir
from tests.core.api.servicekit import Served, serve
from tests.core.processkit import UNIFIED, cgroup2_usable
from tests.security.userkit import ALICE, MALLORY, JobUser
from tests.security.userkit import job_user as make_job_user

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def pytest_configure(config: pytest.Config) -> None:
    """Signals a launcher left ignored go back to their defaults, for this process and so
    for every daemon, template and fiber the tests start: a run under ``nohup`` or ``&``
    in a script inherits SIGHUP, SIGINT or SIGQUIT ignored, an ignored signal stays ignored
    across fork and exec, and the tests that send those signals to fibers would fail."""
    for sig, default in ((signal.SIGHUP, signal.SIG_DFL), (signal.SIGQUIT, signal.SIG_DFL),
                         (signal.SIGINT, signal.default_int_handler)):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, default)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and item.get_closest_marker("machine_may_lack") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which allows no skips here: {reason}"


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock at a fixed, recognisable time."""
    return FakeClock()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server on the real clock (timeouts generous) at tmp_path/fiberd.sock."""
    with serve(tmp_path / "fiberd.sock", SystemClock()) as s:
        yield s


@pytest.fixture
def cgroup_root() -> Iterator[Path]:
    """A new cgroup2 directory of this process's, killed and removed after the test; skips
    where no cgroup2 hierarchy is writable."""
    if not cgroup2_usable():
        pytest.skip(f"no writable cgroup2 hierarchy at {UNIFIED}")
    root = UNIFIED / f"sf-test-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    yield root
    kill(root)
    asyncio.run(wait_empty(root))
    remove_tree(root)


@pytest.fixture(scope="session")
def bare_host_script() -> BareHost:
    """The bare-host script, its runner and its `env` parser (tests cannot import conftest)."""
    return BareHost()


def _can_bring_up() -> str | None:
    """Why this machine cannot run `bare-host up`, or None when it can."""
    if os.geteuid() != 0:
        return "not root"
    if not Path("/etc/debian_version").exists():
        return "not Debian"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    started_here = False
    if bare_host("status", "--json").returncode == 0:
        if os.geteuid() == 0:  # refresh its site venv: the jobs run this checkout's code
            up = bare_host("up", timeout=600)
            assert up.returncode == 0, f"bare-host up (refresh): {up.stderr.strip()[-2000:]}"
    else:
        reason = _can_bring_up()
        if reason:
            pytest.skip(f"no Slurm cluster up and cannot start one: {reason}")
        up = bare_host("up", timeout=600)
        if up.returncode != 0:
            pytest.skip(f"bare-host up failed: {up.stderr.strip()[-2000:]}")
        started_here = True
    variables = exports(bare_host("env").stdout)
    cluster = SlurmCluster(
        env=os.environ | variables,
        run_dir=Path(variables["SLURM_FIBER_CLUSTER_DIR"]),
        nodes=tuple(variables["SLURM_FIBER_CLUSTER_NODES"].split()),
        site_config=Path(variables["SLURM_FIBER_CONFIG"]) if "SLURM_FIBER_CONFIG" in variables
        else None,
        site_venv=Path(variables["SLURM_FIBER_SITE_VENV"])
        if "SLURM_FIBER_SITE_VENV" in variables else None,
    )
    yield cluster
    if started_here:
        bare_host("down")


TEST_USER = "sfjob"


def _account(name: str) -> JobUser:
    if os.geteuid() != 0:
        pytest.skip("creating job users and submitting as them needs root")
    return make_job_user(name)


@pytest.fixture(scope="session")
def test_user() -> JobUser:
    """The non-root job user of the hook tests (useradd once, idempotent); skips when not
    root."""
    return _account(TEST_USER)


@pytest.fixture(scope="session")
def job_user() -> JobUser:
    """The job user of the cluster tests (sfalice)."""
    return _account(ALICE)


@pytest.fixture(scope="session")
def other_user() -> JobUser:
    """A second job user, for one job against another (sfmallory)."""
    return _account(MALLORY)


@pytest.fixture(scope="session")
def _job_dirs(request: pytest.FixtureRequest) -> Iterator[Path]:
    """Where job users' work dirs go: root's, 0755, outside pytest's 0700 tmp root; kept
    (for the jobs' logs) when a test failed."""
    base = Path(tempfile.mkdtemp(prefix="sf-jobs-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    if not request.session.testsfailed:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def private_dir(_job_dirs: Path, request: pytest.FixtureRequest) -> Path:
    """A new root-owned dir (0755) for a private cluster's run dir: under /tmp and reachable
    by all, as munged and job users need (pytest's tmp_path is below a 0700 dir, which
    any concurrent pytest run resets to 0700)."""
    path = _job_dirs / f"private-{request.node.name[:40]}"
    path.mkdir(mode=0o755)
    return path


@pytest.fixture
def job_dir(_job_dirs: Path, request: pytest.FixtureRequest) -> Callable[[JobUser], Path]:
    """``job_dir(user)``: a new work dir owned by ``user``, mode 0700 (no other job user
    reads it; root, the test, does), named for the test (its name's head and a hash of
    its whole id, so that parametrized tests of one name do not share dirs)."""
    counter = itertools.count()
    test = f"{request.node.name[:40]}-{uuid.uuid5(uuid.NAMESPACE_URL, request.node.nodeid).hex[:8]}"
    return lambda user: new_job_dir(_job_dirs / f"{test}-{user.name}-{next(counter)}", user)
