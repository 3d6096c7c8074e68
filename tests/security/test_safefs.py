"""safefs against what a hostile job user plants: links, hard links, FIFOs, foreign owners,
oversize files and directories another user can write. Files are made by the real user
``mallory`` where ownership matters; a FIFO is checked with a bounded subprocess, so a
blocking open fails the test instead of hanging it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber import safefs
from slurm_fiber.safefs import UnsafePath, open_dir, open_file, read_file, write_atomic
from tests.security.publicdirkit import public_dir
from tests.security.userkit import JobUser


@pytest.fixture
def area(tmp_path: Path) -> Path:
    d = tmp_path / "area"
    d.mkdir(mode=0o755)
    return d


@pytest.fixture
def dfd(area: Path) -> Iterator[int]:
    fd = open_dir(area)
    yield fd
    os.close(fd)


@pytest.fixture
def public() -> Iterator[Path]:
    """A scratch dir mallory can reach (not under pytest's 0700 tmp tree); here it replaces
    conftest.py's sticky ``public``."""
    with public_dir() as scratch:
        yield scratch


def as_user(user: JobUser, *argv: str) -> None:
    subprocess.run(argv, check=True, timeout=30, **user.spawn_args())


def test_read_and_write_a_plain_file(area: Path, dfd: int) -> None:
    write_atomic(dfd, "doc.json", b"{}\n", mode=0o640)
    assert (area / "doc.json").read_bytes() == b"{}\n"
    assert (area / "doc.json").stat().st_mode & 0o777 == 0o640
    assert read_file(dfd, "doc.json", max_bytes=3) == b"{}\n"
    assert [p.name for p in area.iterdir()] == ["doc.json"]  # no temporary left
    with pytest.raises(FileNotFoundError):
        read_file(dfd, "absent", max_bytes=10)


def test_a_symlink_is_never_followed(area: Path, dfd: int, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("secret")
    (area / "doc.json").symlink_to(victim)
    with pytest.raises(UnsafePath, match=r"doc\.json is a symbolic link"):
        read_file(dfd, "doc.json", max_bytes=100)
    with pytest.raises(UnsafePath, match="symbolic link"):
        open_file(dfd, "doc.json", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    write_atomic(dfd, "doc.json", b"new")  # replaces the link itself
    assert victim.read_text() == "secret" and not (area / "doc.json").is_symlink()


def test_a_hard_link_is_refused(area: Path, dfd: int, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("x")
    os.link(victim, area / "lock")
    with pytest.raises(UnsafePath, match="2 hard links"):
        open_file(dfd, "lock", os.O_RDWR | os.O_CREAT)
    with pytest.raises(UnsafePath, match="hard links"):
        read_file(dfd, "lock", max_bytes=10)


def test_a_fifo_never_blocks(area: Path) -> None:
    os.mkfifo(area / "state.json")
    probe = (
        "import os, sys\n"
        "from slurm_fiber.safefs import open_dir, read_file, open_file, UnsafePath\n"
        f"fd = open_dir({str(area)!r})\n"
        "for act in (lambda: read_file(fd, 'state.json', max_bytes=10),\n"
        "            lambda: open_file(fd, 'state.json', os.O_WRONLY | os.O_APPEND)):\n"
        "    try:\n"
        "        act()\n"
        "    except UnsafePath as err:\n"
        "        print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and "state.json is a FIFO" in lines[0]
    assert "not a regular file" in lines[1]


def test_a_wrong_owner_is_refused(area: Path, dfd: int, mallory: JobUser) -> None:
    (area / "doc.json").write_text("{}")
    os.chown(area / "doc.json", mallory.uid, mallory.gid)
    with pytest.raises(UnsafePath, match=f"owned by uid {mallory.uid}"):
        read_file(dfd, "doc.json", max_bytes=10, owners=(0,))
    assert read_file(dfd, "doc.json", max_bytes=10, owners=(0, mallory.uid)) == b"{}"


def test_an_oversize_file_is_refused(area: Path, dfd: int) -> None:
    (area / "big").write_bytes(b"x" * 1000)
    with pytest.raises(UnsafePath, match=r"larger than 999 bytes \(1000\)"):
        read_file(dfd, "big", max_bytes=999)
    assert read_file(dfd, "big", max_bytes=1000) == b"x" * 1000


def test_a_name_is_one_component(dfd: int) -> None:
    for bad in ("../x", "a/b", "..", ""):
        with pytest.raises(UnsafePath, match="not a single file name"):
            read_file(dfd, bad, max_bytes=1)


def test_a_directory_another_user_can_write_is_refused(tmp_path: Path,
                                                       mallory: JobUser) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # world-writable, not sticky
    (shared / "inner").mkdir()
    with pytest.raises(UnsafePath, match=r"shared is writable by every user \(mode 0777\)"):
        os.close(open_dir(shared / "inner"))
    shared.chmod(0o775)
    with pytest.raises(UnsafePath, match="writable by its group"):
        os.close(open_dir(shared / "inner"))
    os.close(open_dir(shared / "inner", allow_group_write=True))
    shared.chmod(0o755)
    os.chown(shared, mallory.uid, mallory.gid)
    with pytest.raises(UnsafePath, match=f"owned by uid {mallory.uid}"):
        os.close(open_dir(shared / "inner"))
    os.close(open_dir(shared / "inner", trusted_owners=(mallory.uid,)))


def test_a_sticky_dir_is_passed_only_to_a_trusted_entry(public: Path,
                                                        mallory: JobUser) -> None:
    sticky = public / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "mine").mkdir()
    os.close(open_dir(sticky / "mine"))  # like /tmp/<root's dir>
    with pytest.raises(UnsafePath, match="writable by every user"):
        os.close(open_dir(sticky))  # names inside it are anyone's
    as_user(mallory, "mkdir", str(sticky / "hers"))
    with pytest.raises(UnsafePath, match=f"owned by uid {mallory.uid}"):
        os.close(open_dir(sticky / "hers"))


def test_symlinks_on_the_way_only_when_a_trusted_owner_made_them(public: Path,
                                                                 mallory: JobUser) -> None:
    tmp_path = public
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to("real")
    fd = open_dir(tmp_path / "alias")
    try:
        assert os.fstat(fd).st_ino == real.stat().st_ino
    finally:
        os.close(fd)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    as_user(mallory, "ln", "-s", str(real), str(sticky / "planted"))
    with pytest.raises(UnsafePath, match="symbolic link owned by uid"):
        os.close(open_dir(sticky / "planted"))
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(UnsafePath):
        os.close(open_dir(tmp_path / "loop"))


def test_write_atomic_sets_owner_and_syncs(area: Path, dfd: int, mallory: JobUser) -> None:
    write_atomic(dfd, "grant.jwt", b"t", mode=0o600, uid=mallory.uid, gid=mallory.gid)
    st = (area / "grant.jwt").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (mallory.uid, mallory.gid, 0o600)
    os.mkdir(area / "taken")
    with pytest.raises(OSError, match="taken"):
        write_atomic(dfd, "taken", b"x")  # a directory at the name: refused, nothing left
    assert sorted(p.name for p in area.iterdir()) == ["grant.jwt", "taken"]
    assert safefs.fd_path(dfd, "x") == str(area / "x")


def test_open_dir_makes_missing_dirs_with_exactly_the_mode_asked(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_dir(tmp_path / "a" / "b")
    old = os.umask(0)
    try:
        fd = open_dir(tmp_path / "a" / "b", create_mode=0o700)
    finally:
        os.umask(old)
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(tmp_path / "a" / "b"))
    finally:
        os.close(fd)
    for made in (tmp_path / "a", tmp_path / "a" / "b"):
        assert made.stat().st_mode & 0o7777 == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        open_dir(tmp_path / "file" / "below", create_mode=0o700)


def test_replace_file_by_path_is_write_atomic(area: Path, tmp_path: Path) -> None:
    """The one path-based writer (ready files, the grant book, the JWKS): the mode asked
    whatever the umask, a planted link at the name replaced rather than followed, no
    temporary left, a missing directory an OSError."""
    victim = tmp_path / "victim"
    victim.write_text("secret")
    (area / "ready.json").symlink_to(victim)
    old = os.umask(0o077)
    try:
        safefs.replace_file(area / "ready.json", b"{}\n", mode=0o644)
    finally:
        os.umask(old)
    st = (area / "ready.json").lstat()
    assert (st.st_mode & 0o777, (area / "ready.json").read_bytes()) == (0o644, b"{}\n")
    assert victim.read_text() == "secret"
    assert [p.name for p in area.iterdir()] == ["ready.json"]
    with pytest.raises(FileNotFoundError):
        safefs.replace_file(area / "absent" / "x", b"x")
