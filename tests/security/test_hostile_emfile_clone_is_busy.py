"""Finding (issue 38, low): a Clone that hit EMFILE was answered ``internal``, not ``busy``.

docs/socket-protocol.md promises ``busy`` (retryable) for a request that failed for
want of descriptors. A Clone whose slot leaf could not be made at EMFILE got
``internal: CloneFailed: cannot create cgroup ...: Too many open files``: the errno was
lost on the way up. The cause's errno now travels with the failed fork
(core/templates.py ForkFailed, core/runtime.py CloneFailed) and the API answers it
``busy``. A real root fiberd process, carved on this host's cgroups, held at its
descriptor limit (``prlimit``, as a user exhausting its descriptors would leave it).
"""

from __future__ import annotations

import os
import resource
import subprocess
import uuid
from pathlib import Path

from slurm_fiber.client.connection import FiberdClient, Missed, Refused
from tests.cli.commandkit import fiberd, wait_ready, wait_socket
from tests.core.runtime.fiberdkit import Site


def test_hostile_emfile_on_a_clone_is_busy_not_internal(tmp_path: Path,
                                                        cgroup_root: Path) -> None:
    site = Site(tmp_path, uuid.uuid4().hex)
    site.drop()
    options = {"cgroup-root": str(cgroup_root), "cgroup-backend": "auto", "spares": "0"}
    codes: list[str] = []
    with fiberd(site, options, stderr=subprocess.DEVNULL) as proc:
        sock = wait_socket(site, proc)
        wait_ready(sock)
        with FiberdClient(sock, timeout=20) as client:
            client.request("ready")
            _, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
            for _ in range(20):
                in_use = len(os.listdir(f"/proc/{proc.pid}/fd"))
                resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (in_use, hard))
                for what in ({"exec": {"argv": ["true"]}},
                             {"call": {"target": "tests.core.runtime.targetkit:sleep",
                                       "args": [0]}}):
                    try:
                        client.clone(grant="g1", **what)
                        codes.append("started")
                    except (Refused, Missed) as err:
                        codes.append(err.code)
                        assert err.code != "internal", err
                resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (4096, hard))
    assert "busy" in codes, codes
