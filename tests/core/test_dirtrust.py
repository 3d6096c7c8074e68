"""dirtrust: the walk from "/" that decides whether fiberd may use a directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from slurm_fiber.core.dirtrust import UnsafeDir, safe_path_entry, trusted_dir


def is_dir_fd(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    finally:
        os.close(fd)


def test_a_private_dir_is_trusted_and_a_missing_one_is_made_exactly_0700(
        tmp_path: Path) -> None:
    assert is_dir_fd(trusted_dir(tmp_path), tmp_path)
    with pytest.raises(FileNotFoundError):
        trusted_dir(tmp_path / "a" / "b")
    old = os.umask(0)
    try:
        made = trusted_dir(tmp_path / "a" / "b", create_mode=0o700)
    finally:
        os.umask(old)
    assert is_dir_fd(made, tmp_path / "a" / "b")
    for path in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700


@pytest.mark.parametrize(("mode", "words"), [(0o775, "its group"), (0o757, "others"),
                                             (0o1777, "others")])
def test_a_dir_others_can_write_is_refused_even_when_sticky(tmp_path: Path, mode: int,
                                                            words: str) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(mode)
    with pytest.raises(UnsafeDir, match=f"{loose} is writable by {words}"):
        os.close(trusted_dir(loose))


def test_a_sticky_ancestor_is_fine_only_when_root_owns_it(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    (sticky / "mine").mkdir(parents=True)
    sticky.chmod(0o1777)
    assert is_dir_fd(trusted_dir(sticky / "mine"), sticky / "mine")
    if os.geteuid() == 0:
        os.chown(sticky, 12345, -1)
        with pytest.raises(UnsafeDir, match="sticky is writable by others"):
            os.close(trusted_dir(sticky / "mine", owners={12345}))


def test_symlinks_are_followed_only_when_trusted_and_their_target_is_checked(
        tmp_path: Path) -> None:
    (tmp_path / "real" / "inner").mkdir(parents=True)
    (tmp_path / "link").symlink_to("real")  # relative
    (tmp_path / "up").symlink_to("real/inner/..")  # ".." resolved textually, then walked
    assert is_dir_fd(trusted_dir(tmp_path / "link" / "inner"), tmp_path / "real" / "inner")
    assert is_dir_fd(trusted_dir(tmp_path / "up"), tmp_path / "real")
    (tmp_path / "loose").mkdir(mode=0o700)
    (tmp_path / "loose").chmod(0o777)
    (tmp_path / "to-loose").symlink_to(tmp_path / "loose")
    with pytest.raises(UnsafeDir, match=f"{tmp_path}/loose is writable by others"):
        os.close(trusted_dir(tmp_path / "to-loose"))
    if os.geteuid() == 0:
        os.chown(tmp_path / "link", 12345, -1, follow_symlinks=False)
        with pytest.raises(UnsafeDir, match="link is a symlink owned by uid 12345"):
            os.close(trusted_dir(tmp_path / "link"))


def test_a_file_in_the_way_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeDir, match="is not a directory"):
        os.close(trusted_dir(tmp_path / "file" / "below", create_mode=0o700))


def test_sys_path_entries(tmp_path: Path) -> None:
    assert safe_path_entry(str(tmp_path)) is None
    assert "relative" in str(safe_path_entry(""))
    assert "relative" in str(safe_path_entry("lib"))
    assert "does not exist" in str(safe_path_entry(str(tmp_path / "nope")))
    archive = tmp_path / "lib.zip"
    archive.write_bytes(b"")
    assert safe_path_entry(str(archive)) is None
    archive.chmod(0o666)
    assert "regular file only a trusted owner may write" in str(safe_path_entry(str(archive)))
