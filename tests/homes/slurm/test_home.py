"""The Slurm home on recorded output: verdicts, health rounds, scope loss, readiness, devices.

Slurm's commands are real processes replaying fixtures (replaykit.py); time is a
FakeClock. The real cluster is in test_home_cluster.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jwt
import pytest

from slurm_fiber.core.book.health import HealthState
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.seam import EventKind, Home
from slurm_fiber.core.trust.grant import FiberSpec, ScopeClaim, VerifiedToken
from slurm_fiber.homes.readyfile import writer
from slurm_fiber.homes.slurm.cgroup_root import CgroupChoice
from slurm_fiber.homes.slurm.control import (
    CliControl,
    ControlPlaneError,
)
from slurm_fiber.homes.slurm.gres import gpu_files
from slurm_fiber.homes.slurm.home import (
    DevicesRefused,
    JobNotListed,
    SlurmDownError,
    SlurmHome,
    SlurmHomeConfig,
    job_verdict,
)
from slurm_fiber.homes.slurm.jobenv import job_from_env
from slurm_fiber.homes.slurm.paths import gpu_resource, job_paths, state_root
from slurm_fiber.homes.slurm.readiness import COMMENT_READY
from slurm_fiber.homes.slurm.scontrol import QueueJob, parse_squeue_json
from tests.homes.slurm.replaykit import FIXTURES, Replay, alive, env_file, losses

NO_CGROUP = CgroupChoice(None, "test: no cgroup")


def squeue(name: str, job_id: int) -> QueueJob | None:
    return parse_squeue_json((FIXTURES / name).read_text(), job_id)


def step_env(job_id: int = 6) -> dict[str, str]:
    """The recorded 22.05 `srun --gres=gpu:1` step env, pointed at job ``job_id``."""
    return env_file("env_22.05_step_gpu.env") | {"SLURM_JOB_ID": str(job_id)}


def grant(devices: tuple[str, ...] = ("gpu",)) -> VerifiedToken:
    return VerifiedToken(uid="g1", issuer="site", jti="j", audience=("slurm:citest:6",),
                         exp=2e9, iat=1e9, nbf=None, spec=FiberSpec(devices=devices), raw=b"")


def make_home(tmp_path: Path, clock: FakeClock, replay: Replay | None = None,
              **config: object) -> SlurmHome:
    control = CliControl(replay.env if replay else None, timeout=5)
    cfg = SlurmHomeConfig(state_root=tmp_path / "state", poll_every=1.0, stale_after=3.0,
                          **config)  # type: ignore[arg-type]
    home = SlurmHome(job_from_env(step_env()), clock, control, cfg, cgroup=NO_CGROUP)
    home.paths.state_dir.mkdir(parents=True)
    return home


# ---- pure verdicts on recorded and hand-written squeue output


@pytest.mark.parametrize(("fixture", "job_id", "running", "lost"), [
    ("squeue_22.05_running_and_done.json", 6, True, None),
    ("squeue_22.05_running_and_done.json", 5, False, "job 5 left RUNNING: CANCELLED"),
    ("squeue_22.05_running_and_done.json", 1, False, "job 1 left RUNNING: COMPLETED"),
    ("squeue_24.11_running_and_done.json", 15, True, None),  # ids: recorded_24.11.json
    ("squeue_24.11_running_and_done.json", 16, False, "job 16 left RUNNING: COMPLETED"),
])
def test_verdict_on_fixtures(fixture: str, job_id: int, running: bool, lost: str | None) -> None:
    assert job_verdict(job_id, squeue(fixture, job_id), seen=True) == (running, lost)


def test_verdict_states_and_flags() -> None:
    def job(*states: str) -> QueueJob:
        return QueueJob(job_id=7, states=states)

    assert job_verdict(7, job("RUNNING", "COMPLETING"), seen=True)[1] == (
        "job 7 left RUNNING: RUNNING+COMPLETING")
    assert job_verdict(7, job("PENDING"), seen=False) == (False, None)  # not started yet
    assert job_verdict(7, job("PENDING"), seen=True)[1] == "job 7 left RUNNING: PENDING"  # requeued
    assert job_verdict(7, job("SUSPENDED"), seen=True) == (False, None)
    assert job_verdict(7, job("TIMEOUT"), seen=False)[1] == "job 7 left RUNNING: TIMEOUT"
    assert job_verdict(7, None, seen=True)[1] == "job 7 is no longer listed by slurmctld"
    with pytest.raises(JobNotListed, match="does not list job 7"):
        job_verdict(7, None, seen=False)


# ---- the CLI backend, real processes replaying fixtures


def test_cli_backend_parses_replayed_output(tmp_path: Path) -> None:
    replay = Replay(tmp_path / "r")
    control = CliControl(replay.env)
    assert asyncio.run(control.ping()).up
    listed = asyncio.run(control.job(6))
    assert listed is not None and listed.state == "RUNNING"
    assert asyncio.run(control.job(999)) is None
    replay.ping("scontrol_ping_22.05_down.txt")
    assert not asyncio.run(control.ping()).up
    replay.squeue("squeue_22.05_ctld_down.json")
    with pytest.raises(Exception, match="squeue --json") as err:
        asyncio.run(control.job(6))
    assert getattr(err.value, "code", "") == "slurm_error"
    assert "squeue --json --jobs=6 --states=all" in replay.calls()


def test_cli_backend_kills_a_command_that_overruns(tmp_path: Path) -> None:
    replay = Replay(tmp_path / "r")
    replay.hang()
    with pytest.raises(ControlPlaneError) as err:
        asyncio.run(CliControl(replay.env, timeout=0.3).ping())
    assert err.value.code == "timeout" and "no answer within 0.3 s" in err.value.reason
    assert not alive(replay.hung_pid())


def test_cli_backend_kills_the_command_when_cancelled(tmp_path: Path) -> None:
    replay = Replay(tmp_path / "r")
    replay.hang()

    async def main() -> None:
        task = asyncio.create_task(CliControl(replay.env, timeout=30).ping())
        while not (replay.root / "hang.pid").exists():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not alive(replay.hung_pid())


def test_cli_backend_missing_command(tmp_path: Path) -> None:
    with pytest.raises(ControlPlaneError) as err:
        asyncio.run(CliControl({"PATH": str(tmp_path)}).ping())
    assert err.value.code == "exec_failed"


# ---- health rounds and scope loss, on a FakeClock


def test_rounds_mark_health_and_a_cancelled_job_is_lost_once(tmp_path: Path,
                                                             clock: FakeClock) -> None:
    replay = Replay(tmp_path / "r")
    home = make_home(tmp_path, clock, replay)

    async def main() -> list[str]:
        async with losses(home) as delivered:
            assert home.health().read().state is HealthState.NEVER
            assert await home.poll.once() is None
            assert home.health().read().fresh and home.lost is None
            # job 6 is cancelled: the next rounds find it left RUNNING, then gone.
            replay.squeue(text=json.dumps({"jobs": [{"job_id": 6, "job_state": "CANCELLED"}]}))
            assert await home.poll.once() is None
            replay.squeue(text=json.dumps({"jobs": []}))
            assert await home.poll.once() is None
        return delivered

    delivered = asyncio.run(main())
    assert delivered == ["job 6 left RUNNING: CANCELLED"]
    assert home.lost == delivered[0]


def test_controller_down_goes_stale_and_recovers(tmp_path: Path, clock: FakeClock) -> None:
    replay = Replay(tmp_path / "r")
    home = make_home(tmp_path, clock, replay)
    errors: list[str] = []
    home.poll.on_error = lambda err: errors.append(str(err))

    async def main() -> None:
        assert await home.poll.once() is None
        replay.ping("scontrol_ping_22.05_down.txt")
        for _ in range(4):
            await clock.advance_and_settle(1.0)
            assert isinstance(await home.poll.once(), SlurmDownError)
        assert home.health().read().state is HealthState.STALE
        replay.ping("scontrol_ping_24.11_handwritten_backup.txt")  # primary down, backup up
        assert await home.poll.once() is None
        assert home.health().read().fresh

    asyncio.run(main())
    assert errors == ["slurmctld is DOWN (primary vm)"]
    assert home.lost is None


def test_a_hung_controller_times_the_round_out(tmp_path: Path, clock: FakeClock) -> None:
    replay = Replay(tmp_path / "r")
    replay.hang()
    home = make_home(tmp_path, clock, replay)

    async def main() -> BaseException | None:
        round_ = asyncio.create_task(home.poll.once())
        while not (replay.root / "hang.pid").exists():
            await asyncio.sleep(0.01)
        await clock.advance_and_settle(1.0)
        return await round_

    err = asyncio.run(main())
    assert isinstance(err, TimeoutError) and str(err) == "poll round timed out"
    assert not alive(replay.hung_pid())
    assert home.health().read().state is HealthState.NEVER


def test_a_job_never_listed_is_an_error_not_a_loss(tmp_path: Path, clock: FakeClock) -> None:
    replay = Replay(tmp_path / "r")
    replay.squeue(text='{"jobs": []}')
    home = make_home(tmp_path, clock, replay)
    assert isinstance(asyncio.run(home.poll.once()), JobNotListed)
    assert home.lost is None and not home.health().read().fresh


# ---- scope, grants, readiness, devices


def test_scope_from_the_recorded_step_env(tmp_path: Path, clock: FakeClock) -> None:
    home = make_home(tmp_path, clock)
    assert isinstance(home, Home) and home.name() == "slurm"
    assert home.scope() == [
        ScopeClaim("slurm.cluster", "citest"), ScopeClaim("slurm.job_id", "6"),
        ScopeClaim("slurm.user", "root"), ScopeClaim("slurm.partition", "debug"),
        ScopeClaim("slurm.node", "n1"), ScopeClaim("slurm.job_name", "plain"),
    ]
    home._listed = squeue("squeue_24.11_running_and_done.json", 13)  # slurmctld names the account
    assert ScopeClaim("slurm.account", "proj1") in home.scope()


def test_paths_convention(tmp_path: Path) -> None:
    paths = job_paths("/var/lib/slurm-fiber", "n1", 42)
    assert paths.grantdir == Path("/var/lib/slurm-fiber/nodes/n1/jobs/42/grants")
    assert paths.socket.parent == paths.state_dir and paths.socket_fits()
    assert paths.lease_dir == Path("/var/lib/slurm-fiber/nodes/n1/leases")
    assert not job_paths("/" + "x" * 100, "n1", 42).socket_fits()
    assert gpu_resource("n1", 0) == "gpu:n1:0"
    assert state_root({}) == Path("/var/lib/slurm-fiber")
    assert state_root({"SLURM_FIBER_STATE_ROOT": "/srv/sf"}) == Path("/srv/sf")
    with pytest.raises(ValueError, match="absolute"):
        state_root({"SLURM_FIBER_STATE_ROOT": "relative"})


def test_grants_come_from_the_jobs_grantdir(tmp_path: Path, clock: FakeClock) -> None:
    home = make_home(tmp_path, clock)
    home.health().mark_sync()  # the control plane answers
    token = jwt.encode({"sub": "g1"}, "k" * 32, algorithm="HS256").encode()

    async def first() -> object:
        events = await home.grants()  # a missing grantdir is waited for, health stale
        assert events is not None
        pending = asyncio.ensure_future(anext(events))
        await clock.settle()
        assert not pending.done() and not home.health().read().fresh
        assert "grantdir" in str(home.health().read().down)
        home.paths.grantdir.mkdir(mode=0o700)
        (home.paths.grantdir / "g1.jwt").write_bytes(token)
        await clock.advance_and_settle(home.config.grant_poll_every)
        return await pending

    event = asyncio.run(first())
    assert event.kind is EventKind.GRANT_ADDED and event.token == token  # type: ignore[attr-defined]
    assert home.health().read().fresh


def test_readiness_goes_to_the_file_and_the_comment(tmp_path: Path, clock: FakeClock) -> None:
    replay = Replay(tmp_path / "r")
    home = make_home(tmp_path, clock, replay, publish_comment=True)
    asyncio.run(home.publish_ready("g1", True))
    doc = json.loads(home.paths.ready_file.read_text())
    assert doc == {"job_id": 6, "ready": True, "warm": ["g1"], "updated": clock.wall(),
                   **writer()}  # the writer, which readers check is alive
    assert f"update JobId=6 Comment={COMMENT_READY}" in replay.calls()
    replay.refuse_updates()
    with pytest.raises(ControlPlaneError, match="Access/permission denied"):
        asyncio.run(home.publish_ready("g1", False))
    assert json.loads(home.paths.ready_file.read_text())["ready"] is False  # the file is first


class Ledger:
    """A DeviceLeases over a dict (the lease package is not on main yet): who holds what."""

    def __init__(self, held: dict[str, str] | None = None) -> None:
        self.held = dict(held or {})
        self.log: list[str] = []

    def claim(self, resource: str) -> None:
        holder = self.held.get(resource)
        if holder not in (None, "job 6"):
            raise DevicesRefused("device_held", f"{resource} is held by {holder}")
        self.held[resource] = "job 6"
        self.log.append(f"claim {resource}")

    def release(self, resource: str) -> None:
        self.held.pop(resource, None)
        self.log.append(f"release {resource}")


def test_devices_are_the_jobs_gpus_claimed_and_released(tmp_path: Path, clock: FakeClock) -> None:
    home = make_home(tmp_path, clock, gpu_files={1: "/dev/nvidia1"})
    home.leases = ledger = Ledger()
    channel, release = asyncio.run(home.devices(grant()))
    assert [(d.kind, d.index, d.path) for d in channel.devices] == [("gpu", 1, "/dev/nvidia1")]
    assert channel.env()["CUDA_VISIBLE_DEVICES"] == "1"
    second, release_second = asyncio.run(home.devices(grant()))  # another grant, same job
    assert second == channel
    assert home.held_resources() == {"gpu:n1:1"}
    release()
    release()  # idempotent
    assert ledger.held == {"gpu:n1:1": "job 6"}  # still used by the second grant
    assert home.held_resources() == {"gpu:n1:1"}
    release_second()
    assert ledger.held == {} and ledger.log == ["claim gpu:n1:1", "release gpu:n1:1"]
    assert home.held_resources() == frozenset()
    none, release_none = asyncio.run(home.devices(grant(devices=())))
    assert none.devices == () and none.env()["CUDA_VISIBLE_DEVICES"] == ""
    release_none()


def test_a_gpu_held_by_another_job_is_refused(tmp_path: Path, clock: FakeClock) -> None:
    home = make_home(tmp_path, clock)
    home.job = job_from_env(step_env() | {"SLURM_STEP_GPUS": "0-1"})
    home.leases = ledger = Ledger({"gpu:n1:1": "job 5"})
    with pytest.raises(DevicesRefused) as err:
        asyncio.run(home.devices(grant()))
    assert err.value.code == "device_held" and err.value.reason == "gpu:n1:1 is held by job 5"
    assert ledger.held == {"gpu:n1:1": "job 5"}  # gpu 0, claimed first, was given back


def test_gres_conf_device_files() -> None:
    text = ("AutoDetect=off\n# comment\n"
            "NodeName=n[1-2] Name=gpu File=/dev/nvidia[0-1]\n"
            "NodeName=n3 Name=gpu File=/dev/nvidia7\n"
            "Name=gpu File=/dev/extra0  # every node\n"
            "NodeName=n1 Name=mps Count=100\n")
    assert gpu_files(text, "n1") == {0: "/dev/nvidia0", 1: "/dev/nvidia1", 2: "/dev/extra0"}
    assert gpu_files(text, "n3") == {0: "/dev/nvidia7", 1: "/dev/extra0"}
    assert gpu_files("", "n1") == {}


def test_the_jobs_end_ends_fiberd_after_its_fibers(tmp_path: Path, clock: FakeClock) -> None:
    """A fiberd carving its task cgroup no longer gets Slurm's SIGTERM: once the scope loss
    has stopped every fiber (the handler returned), the home calls ``on_job_end`` (fiberd-run:
    its own SIGTERM), never before."""
    home = make_home(tmp_path, clock)
    order: list[str] = []
    home.on_job_end = lambda reason: order.append(f"end: {reason}")

    async def handler(reason: str, removes: bool) -> None:
        await asyncio.sleep(0.05)  # fibers stopping
        order.append(f"stopped: {reason} {removes}")

    async def scenario() -> None:
        home.on_scope_lost(handler)
        runner = asyncio.create_task(home.scope_loss.run())
        home.scope_loss.lose("job 6 left RUNNING: COMPLETED")
        for _ in range(100):
            if len(order) == 2:
                break
            await asyncio.sleep(0.01)
        runner.cancel()

    asyncio.run(scenario())
    assert order == ["stopped: job 6 left RUNNING: COMPLETED True",
                     "end: job 6 left RUNNING: COMPLETED"]
