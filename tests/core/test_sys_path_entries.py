"""dirtrust: which sys.path entries a template may import from (the walk is safefs's)."""

from __future__ import annotations

from pathlib import Path

from slurm_fiber.core.templates.dirtrust import safe_path_entry


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


def test_a_dir_others_can_write_is_not_an_entry(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    assert "writable by every user" in str(safe_path_entry(str(loose)))
    loose.chmod(0o775)
    assert "writable by its group" in str(safe_path_entry(str(loose)))
