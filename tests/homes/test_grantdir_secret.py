"""grantdir's Secret-volume mode against real ``..data`` swaps, looked at between every step.

The volume is written by ``atomicwriter`` the way the kubelet writes it; the
grantdir is polled after each step of each write, so every state a reader
can meet mid-swap is met.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes import GrantDirRefused
from slurm_fiber.testing.kubernetes.fake.secretvolume import atomic_write, write_secret
from tests.homes.grantdirkit import Dir
from tests.homes.homekit import token


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    path = tmp_path / "grants"
    path.mkdir(mode=0o755)
    return path


def secret_dir(volume: Path, clock: FakeClock) -> Dir:
    return Dir(volume, clock, secret_volume=True)


def polled_write(d: Dir, payload: Mapping[str, bytes]) -> list[tuple[str, str]]:
    """Write ``payload`` as the kubelet does, polling after every step; all events seen."""
    seen: list[tuple[str, str]] = []
    for _step in atomic_write(d.path, payload):
        seen += d.poll()
    return seen + d.poll()


def test_each_rotated_token_is_added_once_and_nothing_is_removed(
    volume: Path, clock: FakeClock
) -> None:
    d = secret_dir(volume, clock)
    assert polled_write(d, {"grant.jwt": token("alpha", "j1")}) == [("added", "alpha")]
    for jti in ("j2", "j3", "j4"):
        assert polled_write(d, {"grant.jwt": token("alpha", jti)}) == [("added", "alpha")]
    assert polled_write(d, {"grant.jwt": token("alpha", "j4")}) == [], "same content: nothing"
    assert d.problems == []


def test_a_token_moved_to_a_new_key_is_added_once_and_its_uid_never_removed(
    volume: Path, clock: FakeClock
) -> None:
    d = secret_dir(volume, clock)
    polled_write(d, {"grant.jwt": token("alpha", "j1"), "other.jwt": token("beta")})
    renewed = {"grant-renewed.jwt": token("alpha", "j2"), "other.jwt": token("beta")}
    assert polled_write(d, renewed) == [("added", "alpha")]
    assert d.gd.uids() == {"alpha", "beta"}
    assert d.problems == []


def test_a_key_dropped_from_the_secret_removes_its_grant_once(
    volume: Path, clock: FakeClock
) -> None:
    d = secret_dir(volume, clock)
    polled_write(d, {"a.jwt": token("alpha"), "b.jwt": token("beta")})
    assert polled_write(d, {"a.jwt": token("alpha")}) == [("removed", "beta")]
    assert d.problems == []


def test_links_that_do_not_resolve_into_the_current_data_are_refused(
    volume: Path, clock: FakeClock, tmp_path: Path
) -> None:
    write_secret(volume, {"grant.jwt": token("alpha")})
    old = volume / "..2020_01_01_00_00_00.1"
    old.mkdir()
    (old / "old.jwt").write_bytes(token("stale"))
    (volume / "old.jwt").symlink_to(f"{old.name}/old.jwt")
    (tmp_path / "outside.jwt").write_bytes(token("outside"))
    (volume / "out.jwt").symlink_to(tmp_path / "outside.jwt")
    d = secret_dir(volume, clock)
    assert d.poll() == [("added", "alpha")]
    assert d.codes() == ["symlink_escapes", "symlink_escapes"]
    os.unlink(volume / "..data")
    (volume / "..data").symlink_to(tmp_path)
    assert d.poll() == []
    assert "..data points outside the grantdir" in d.problems[-1].reason


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A tmpfs of mode 1777 (the kubelet's side) bind-mounted read-only (the container's)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    writer, reader = tmp_path / "kubelet", tmp_path / "container"
    writer.mkdir()
    reader.mkdir()
    mounts: list[Path] = []
    try:
        for args in (["-t", "tmpfs", "-o", "mode=1777", "tmpfs", str(writer)],
                     ["--bind", str(writer), str(reader)],
                     ["-o", "remount,bind,ro", str(reader)]):
            done = subprocess.run(["mount", *args], capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot mount here: {done.stderr.strip()}")
            if Path(args[-1]) not in mounts:
                mounts.append(Path(args[-1]))
        yield writer, reader
    finally:
        for path in reversed(mounts):
            subprocess.run(["umount", str(path)], check=True)


@pytest.mark.machine_may_lack("root and mount(8), to lay out a Secret volume as the kubelet does")
def test_a_world_writable_volume_is_accepted_only_when_mounted_read_only(
    mounted: tuple[Path, Path], clock: FakeClock
) -> None:
    writer, reader = mounted
    write_secret(writer, {"grant.jwt": token("alpha")})
    d = secret_dir(reader, clock)
    d.gd.check()
    assert d.poll() == [("added", "alpha")]
    for_writer = secret_dir(writer, clock)
    with pytest.raises(GrantDirRefused) as refused:
        for_writer.gd.check()
    assert refused.value.code == "grantdir_writable"
    plain = Dir(reader, clock)
    with pytest.raises(GrantDirRefused):
        plain.gd.check()  # only the Secret-volume mode accepts it
