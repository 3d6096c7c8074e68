"""Claiming the socket path safely, and where clients look for it."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest

from slurm_fiber.client.discovery import discover_socket
from slurm_fiber.core.api.sockfile import SocketPathError, claim_socket


def test_claims_with_mode_and_releases_only_its_own(tmp_path) -> None:
    path = tmp_path / "d.sock"
    claimed = claim_socket(path, mode=0o660)
    assert stat.S_ISSOCK(os.lstat(path).st_mode) and os.lstat(path).st_mode & 0o777 == 0o660
    claimed.release()
    assert not path.exists() and not (tmp_path / "d.sock.lock").exists()
    claimed.release()  # idempotent


def test_a_live_server_is_not_clobbered(tmp_path) -> None:
    path = tmp_path / "d.sock"
    first = claim_socket(path)
    with pytest.raises(SocketPathError, match="in use"):
        claim_socket(path)  # lock held
    os.unlink(tmp_path / "d.sock.lock")  # a server that does not lock: the probe still sees it
    with pytest.raises(SocketPathError, match="live socket"):
        claim_socket(path)
    first.release()


def test_a_stale_socket_is_replaced_and_other_files_are_left_alone(tmp_path) -> None:
    path = tmp_path / "d.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # bound, never listening, owner gone: stale
    claim_socket(path).release()
    path.write_text("precious")
    with pytest.raises(SocketPathError, match="not a socket"):
        claim_socket(path)
    assert path.read_text() == "precious"
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SocketPathError, match="not a socket"):
        claim_socket(path)
    assert path.is_symlink()


def test_discovery_order(tmp_path) -> None:
    job = {"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n2", "SLURM_FIBER_STATE_ROOT": "/var/sf",
           "SLURM_FIBER_CONFIG": str(tmp_path / "none.toml")}
    assert str(discover_socket("/x.sock", {"FIBERD_SOCKET": "/y"})) == "/x.sock"
    assert str(discover_socket(None, {"FIBERD_SOCKET": "/y", **job})) == "/y"
    assert str(discover_socket(None, job)) == "/var/sf/nodes/n2/jobs/42/fiberd.sock"
    assert str(discover_socket(None, {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1",
                                      "SLURM_FIBER_CONFIG": str(tmp_path / "none.toml")})) == \
        "/var/lib/slurm-fiber/nodes/n1/jobs/7/fiberd.sock"
    site = tmp_path / "site.toml"
    site.write_text('state_root = "/srv/site"\n')
    in_site = {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1", "SLURM_FIBER_CONFIG": str(site)}
    assert str(discover_socket(None, in_site)) == "/srv/site/nodes/n1/jobs/7/fiberd.sock"
    assert str(discover_socket(None, {"FIBERD_STATE_DIR": "/srv/f"})) == "/srv/f/fiberd.sock"
    assert str(discover_socket(None, {})) == "/var/lib/slurm-fiber/fiberd.sock"


def test_a_job_socket_is_found_from_the_site_state_root_alone(tmp_path) -> None:
    site = tmp_path / "etc" / "site.toml"
    site.parent.mkdir()
    job = {"SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n1", "SLURM_FIBER_CONFIG": str(site)}
    site.write_text('state_root = "state"\n')  # relative: to the file's directory
    assert discover_socket(None, job) == str(tmp_path / "etc/state/nodes/n1/jobs/9/fiberd.sock")
    site.write_text('state_root = 5\n')  # fiberd-run would refuse it: the default root
    assert str(discover_socket(None, job)) == "/var/lib/slurm-fiber/nodes/n1/jobs/9/fiberd.sock"
    site.write_text("state_root = [\n")  # not TOML: the default root
    assert str(discover_socket(None, job)) == "/var/lib/slurm-fiber/nodes/n1/jobs/9/fiberd.sock"
    code = ("import sys; from slurm_fiber.client.discovery import discover_socket; "
            f"discover_socket(None, {job!r}); print('slurm_fiber.core.trust.grant' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"  # nothing but the one key is built


def test_a_clients_job_socket_is_where_the_jobs_paths_put_it(tmp_path) -> None:
    from slurm_fiber.homes.slurm.paths import job_paths

    site = tmp_path / "site.toml"
    for root in ("/srv/sf", "rel/state"):
        site.write_text(f'state_root = "{root}"\n')
        job = {"SLURM_JOB_ID": "12", "SLURMD_NODENAME": "n1", "SLURM_FIBER_CONFIG": str(site)}
        expected = job_paths(tmp_path / root, "n1", 12).socket  # what fiberd-run listens on
        assert discover_socket(None, job) == str(expected)
    with pytest.raises(ValueError, match="not a node name"):
        discover_socket(None, {**job, "SLURMD_NODENAME": ".."})
