"""Dir: mkdir-based claims, the holder record, and interop with a plain shell lock."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_fiber.lease.dirlease import BEING_CLAIMED, Dir
from slurm_fiber.lease.errors import LeaseError
from slurm_fiber.lease.holder import Holder, ProcessRef, compose_session, split_session
from slurm_fiber.lease.state import Party


def rec(res: str, since: str = "2027-01-01T00:00:00Z", **kw: object) -> Holder:
    base = {"holder": "ann", "session": "s1", "purpose": "train", "since": since}
    return Holder(env=res, **{**base, **kw})  # type: ignore[arg-type]


def test_claim_get_release(tmp_path: Path) -> None:
    d = Dir(tmp_path / "leases")
    assert d.get("gpu0") is None
    assert d.claim("gpu0", rec("gpu0")) is None
    assert d.get("gpu0") == rec("gpu0")
    other = rec("gpu0", holder="bob", session="s2")
    assert d.claim("gpu0", other) == rec("gpu0"), "a held resource returns its holder"
    assert d.get("gpu0") == rec("gpu0"), "nothing overwritten"
    d.release("gpu0")
    assert d.get("gpu0") is None
    d.release("gpu0")  # releasing a free resource is a no-op
    assert d.claim("gpu0", other) is None


def test_list_oldest_first_skips_hidden_and_files(tmp_path: Path) -> None:
    d = Dir(tmp_path)
    d.claim("b", rec("b", "2027-01-01T00:00:02Z"))
    d.claim("a", rec("a", "2027-01-01T00:00:03.5Z"))
    d.claim("c", rec("c", "2027-01-01T00:00:01.000001+00:00"))
    (tmp_path / "state.json").write_text("{}")
    (tmp_path / ".released.x.1").mkdir()
    assert [h.env for h in d.list()] == ["c", "b", "a"]


def test_json_names_and_omit_when_empty(tmp_path: Path) -> None:
    d = Dir(tmp_path)
    d.claim("gpu0", rec("gpu0"))
    on_disk = json.loads((tmp_path / "gpu0" / "holder.json").read_text())
    assert on_disk == {
        "env": "gpu0", "holder": "ann", "session": "s1", "purpose": "train",
        "since": "2027-01-01T00:00:00Z",
    }
    full = rec("m", host_session="hs", name="n", person="p", team="t", host="h",
               upgrade_unblock="why", budget_gib=24)
    assert set(full.to_json()) == {
        "env", "holder", "session", "hostSession", "name", "person", "team", "host",
        "purpose", "since", "upgradeUnblock", "budgetGiB",
    }
    assert Holder.from_json(full.to_json(), "x") == full


def test_label_party_since_time() -> None:
    h = rec("models", budget_gib=24, person="ann", team="ml", host="vm",
            session=compose_session("job-7", ProcessRef(42, 1.5)))
    assert h.label() == "models (24 GiB)" and rec("gpu0").label() == "gpu0"
    assert h.party() == Party(session="job-7", person="ann", team="ml", host="vm")
    assert h.process() == ProcessRef(42, 1.5)
    assert h.since_time() == 1_798_761_600.0
    assert rec("x", since="yesterday").since_time() == 0.0


def test_session_strings() -> None:
    assert split_session("job-7") == ("job-7", None)
    assert split_session("@pid:9") == ("", ProcessRef(9, None))
    assert split_session("a@b@pid:9:12.25") == ("a@b", ProcessRef(9, 12.25))


def test_directory_without_record_is_held_by_an_unknown_holder(tmp_path: Path) -> None:
    d = Dir(tmp_path)
    (tmp_path / "gpu0").mkdir()
    found = d.get("gpu0")
    assert found is not None and found.holder == "?" and found.purpose == BEING_CLAIMED
    assert d.claim("gpu0", rec("gpu0")) == found
    assert [h.env for h in d.list()] == ["gpu0"]


SHELL_CLAIM = r"""
set -e
d="$1/$2"
mkdir "$d" 2>/dev/null || { echo held; exit 1; }
printf '{"env":"%s","holder":"%s","session":"%s","purpose":"%s","since":"%s"}\n' \
  "$2" "$USER" "shell-1@pid:$$" "from bash" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$d/.h.$$"
mv "$d/.h.$$" "$d/holder.json"
"""

SHELL_READ = r"""
jq -r '[.env, .holder, .session, .purpose, .since] | join("|")' "$1/$2/holder.json"
"""


def test_shell_lock_claims_and_python_reads(tmp_path: Path) -> None:
    run = subprocess.run(["bash", "-c", SHELL_CLAIM, "sh", str(tmp_path), "kind-lab"],
                         env={"USER": "ann", "PATH": "/usr/bin:/bin"}, capture_output=True)
    assert run.returncode == 0, run.stderr
    h = Dir(tmp_path).get("kind-lab")
    assert h is not None and (h.env, h.holder, h.purpose) == ("kind-lab", "ann", "from bash")
    assert h.party().session == "shell-1" and h.process() is not None
    assert h.since_time() > 0
    assert Dir(tmp_path).claim("kind-lab", rec("kind-lab")) == h


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq, the shell reader, is not installed")
def test_python_claims_and_shell_reads(tmp_path: Path) -> None:
    Dir(tmp_path).claim("gpu1", rec("gpu1", purpose="from python", budget_gib=8))
    again = subprocess.run(["bash", "-c", SHELL_CLAIM, "sh", str(tmp_path), "gpu1"],
                           capture_output=True, text=True)
    assert again.returncode == 1 and again.stdout.strip() == "held"
    read = subprocess.run(["bash", "-c", SHELL_READ, "sh", str(tmp_path), "gpu1"],
                          capture_output=True, text=True, check=True)
    assert read.stdout.strip() == "gpu1|ann|s1|from python|2027-01-01T00:00:00Z"
    subprocess.run(["rm", "-rf", str(tmp_path / "gpu1")], check=True)  # the shell's release
    assert Dir(tmp_path).get("gpu1") is None


@pytest.mark.parametrize("name", ["a/b", "..", "../x", "x\0y", ".hidden", "", "x" * 129, "a b"])
def test_bad_resource_names_are_refused(tmp_path: Path, name: str) -> None:
    from slurm_fiber.lease.errors import LeaseError

    for call in (lambda: Dir(tmp_path).claim(name, rec(name)), lambda: Dir(tmp_path).get(name),
                 lambda: Dir(tmp_path).release(name)):
        with pytest.raises(LeaseError, match="is not allowed") as err:
            call()
        assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_links_and_fifos_in_a_cooperative_dir_are_unreadable_never_followed(
        tmp_path: Path) -> None:
    d = Dir(tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps(rec("gpu0").to_json()))
    (tmp_path / "gpu0").mkdir()
    (tmp_path / "gpu0" / "holder.json").symlink_to(secret)
    (tmp_path / "gpu1").mkdir()
    os.mkfifo(tmp_path / "gpu1" / "holder.json")  # would block a plain open()
    (tmp_path / "gpu2").symlink_to(tmp_path / "gpu1")
    listed = {h.env: h for h in d.list()}
    assert sorted(listed) == ["gpu0", "gpu1"]  # a link is never a lease
    assert listed["gpu0"].holder == "?" and "symbolic link" in listed["gpu0"].purpose
    assert listed["gpu1"].holder == "?" and "is a FIFO" in listed["gpu1"].purpose
    with pytest.raises(LeaseError, match="not a lease directory"):
        d.get("gpu2")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another uid needs root")
def test_an_owned_dir_trusts_only_its_owners_entries(tmp_path: Path) -> None:
    root = tmp_path / "leases"
    Dir(root).claim("gpu0", rec("gpu0"))
    Dir(root).claim("gpu1", rec("gpu1"))
    os.chown(root / "gpu1", 4242, 4242)  # a lease dir made by another user
    os.chown(root / "gpu0" / "holder.json", 4242, 4242)  # a record another user wrote
    owned = Dir(root, owners=(0,))
    with pytest.raises(LeaseError, match=r"belongs to uid 4242.*untrusted, not a lease"):
        owned.get("gpu1")
    with pytest.raises(LeaseError, match="owned by uid 4242"):
        owned.get("gpu0")
    assert {h.holder for h in owned.list()} == {"?"}
    assert Dir(root).get("gpu1") == rec("gpu1")  # cooperative: anyone's record counts
    root.chmod(0o777)
    with pytest.raises(LeaseError, match=r"writable by every user.*not trusted"):
        owned.get("gpu1")
