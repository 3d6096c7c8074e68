"""Hostile input: corrupt records and state, unknown fields, huge purposes, a read-only dir.

Every case ends in a one-line LeaseError (or exit 1 from the command) and
leaves every valid file byte-for-byte as it was.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.lease.dirlease import Dir
from slurm_fiber.lease.errors import LeaseError
from slurm_fiber.lease.holder import Holder
from slurm_fiber.lease.leases import Caller, Leases
from slurm_fiber.lease.names import MAX_PURPOSE
from slurm_fiber.lease.state import Party, load

ANN = Caller(Party(session="s1", person="ann", host="vm"))
GOOD = {"env": "gpu0", "holder": "ann", "session": "s1", "purpose": "p",
        "since": "2027-01-01T00:00:00Z"}


def one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(err.value)
    assert text and "\n" not in text and "Traceback" not in text
    return text


def put_record(root: Path, res: str, content: str) -> Path:
    (root / res).mkdir(parents=True)
    path = root / res / "holder.json"
    path.write_text(content)
    return path


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ('{"env": "gpu0", "holder": "ann", "sess', "not valid JSON"),
        ("", "not valid JSON"),
        ("\xff\xfe", "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps(GOOD | {"pid": 4}), "unknown field 'pid'"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "since"}), "lacks field 'since'"),
        (json.dumps(GOOD | {"budgetGiB": "8"}), "'budgetGiB' is not a int"),
        (json.dumps(GOOD | {"budgetGiB": True}), "'budgetGiB' is not a int"),
        (json.dumps(GOOD | {"env": "gpu1"}), "names 'gpu1'"),
        ('{"env": "gpu0", "purpose": "' + "x" * 70_000 + '"}', "larger than"),
    ],
)
def test_bad_holder_record(tmp_path: Path, content: str, says: str) -> None:
    path = put_record(tmp_path, "gpu0", content)
    before = path.read_bytes()
    d = Dir(tmp_path)
    with pytest.raises(LeaseError) as err:
        d.get("gpu0")
    assert says in one_line(err) and str(path) in str(err.value)
    with pytest.raises(LeaseError):
        d.claim("gpu0", Holder.from_json(GOOD | {"holder": "bob", "session": "s2"}, "test"))
    listed = d.list()
    assert [h.env for h in listed] == ["gpu0"] and listed[0].purpose.startswith("(unreadable")
    leases = Leases(tmp_path, tmp_path / "state.json", FakeClock())
    with pytest.raises(LeaseError):
        leases.claim("gpu0", ANN, "mine now")
    with pytest.raises(LeaseError):
        leases.release("gpu0", ANN)
    assert path.read_bytes() == before, "nothing overwritten"
    leases.release("gpu0", ANN, force=True)  # the deliberate way out
    assert d.get("gpu0") is None


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ('{"grants": [{"resource": "gpu0", "to": {"session": "a"}', "not valid JSON"),
        ('{"grants": {}}', "'grants' is not a list"),
        ('{"grants": [{"resource": "gpu0", "to": {"session": "a"}, "by": {}, '
         '"at": "2027-01-01T00:00:00Z", "tp": 1}]}', "grants[0] has unknown field 'tp'"),
        ('{"grants": [{"resource": "../x", "to": {}, "by": {}, "at": "2027-01-01T00:00:00Z"}]}',
         "is not allowed"),
        ('{"supervisor": {"party": {"sesion": "x"}, "since": "2027-01-01T00:00:00Z"}}',
         "supervisor.party has unknown field 'sesion'"),
        ('{"supervisor": {"party": {}, "since": "noon"}}', "not an RFC 3339 time"),
        ('{"released": {"gpu0": 5}}', "'released' is not an object"),
        ("null", "not a JSON object"),
    ],
)
def test_bad_state_document(tmp_path: Path, doc: str, says: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(doc)
    with pytest.raises(LeaseError) as err:
        load(path)
    assert says in one_line(err)
    leases = Leases(tmp_path / "leases", path, FakeClock())
    for call in (lambda: leases.claim("gpu0", ANN, "p"), leases.prune,
                 lambda: leases.supervise_start(ANN)):
        with pytest.raises(LeaseError):
            call()
    assert path.read_text() == doc, "a bad state document is never overwritten"
    assert Dir(tmp_path / "leases").get("gpu0") is None, "no claim without readable rules"


def test_unknown_top_level_state_fields_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text('{"future": {"x": [1, 2]}, "grants": []}')
    leases = Leases(tmp_path, path, FakeClock())
    leases.supervise_start(ANN)
    assert json.loads(path.read_text())["future"] == {"x": [1, 2]}


def test_huge_and_multiline_purpose(tmp_path: Path) -> None:
    leases = Leases(tmp_path, tmp_path / "state.json", FakeClock())
    for purpose, says in [("x" * 10_000_000, "characters long"), ("a\nb", "one printable line"),
                          ("  ", "needs a purpose")]:
        with pytest.raises(LeaseError) as err:
            leases.claim("gpu0", ANN, purpose)
        assert says in one_line(err)
    assert leases.claim("gpu0", ANN, "x" * MAX_PURPOSE).purpose == "x" * MAX_PURPOSE


@pytest.fixture
def readonly_dir(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs holding one valid lease and a state document, remounted read-only."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        leases = Leases(mnt, mnt / "state.json", FakeClock())
        leases.supervise_start(ANN)
        leases.claim("gpu0", ANN, "valid")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.machine_may_lack("mounting a tmpfs needs root and mount rights")
def test_read_only_lease_dir(readonly_dir: Path) -> None:
    before = {p: p.read_bytes() for p in readonly_dir.rglob("*") if p.is_file()}
    d = Dir(readonly_dir)
    holder = d.get("gpu0")
    assert holder is not None
    with pytest.raises(LeaseError) as err:
        d.claim("gpu1", Holder.from_json(GOOD | {"env": "gpu1"}, "test"))
    assert "Read-only file system" in one_line(err)
    with pytest.raises(LeaseError) as err:
        d.release("gpu0")
    assert "Read-only file system" in one_line(err)
    leases = Leases(readonly_dir, readonly_dir / "state.json", FakeClock())
    with pytest.raises(LeaseError) as err:
        leases.claim("gpu1", ANN, "p")
    one_line(err)
    assert {p: p.read_bytes() for p in readonly_dir.rglob("*") if p.is_file()} == before
    assert [h.env for h in d.list()] == ["gpu0"]
