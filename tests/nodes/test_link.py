"""The relay and its link against a real standalone fiberd, the relay run as a local
process in srun's place (the same stdin/stdout pipes): tasks run through it with their
output passed back, batches and windows included, and a relay whose fiberd is gone ends
the link's connections (the 2-node cluster's tests run it under srun:
tests/cli/test_fibermap_nodes.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from slurm_fiber.cli.throwaway import Site
from slurm_fiber.client.connection import Unreachable
from slurm_fiber.client.nodes.link import Link
from slurm_fiber.client.tasks import Task, TaskRunner, UntrustedServer
from tests.executor.sitekit import started_site, stop_site


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    s = started_site(tmp_path_factory.mktemp("site"))
    yield s
    stop_site(s)


def local_link(socket: str, uids: list[int] | None = None) -> Link:
    """A Link whose relay is a local process (srun's place)."""
    return Link("here", server_uids=uids, command=[
        sys.executable, "-m", "slurm_fiber.client.nodes.relay", "--socket", socket])


def read(fd: int) -> bytes:
    return os.pread(fd, 1 << 20, 0)


def test_tasks_run_through_the_relay_with_their_output(site: Site) -> None:
    link = local_link(str(site.socket), [os.getuid()])
    runner = TaskRunner("here:fiberd", opener=link.open)
    try:
        fds = [(os.memfd_create("o"), os.memfd_create("e")) for _ in range(5)]
        tasks = [Task(exec={"argv": ["sh", "-c", f"echo out{i}; echo err{i} >&2; exit {i}"]},
                      stdio={"stdout": o, "stderr": e}) for i, (o, e) in enumerate(fds)]
        one = runner.run(tasks[0])
        assert one.ok and read(fds[0][0]) == b"out0\n" and read(fds[0][1]) == b"err0\n"
        outcomes = runner.run_many(tasks[1:], window=2)  # a windowed batch
        assert [o.status for o in outcomes] == [1, 2, 3, 4]
        assert [read(o) for o, _ in fds[1:]] == [b"out1\n", b"out2\n", b"out3\n", b"out4\n"]
        assert [read(e) for _, e in fds[1:]] == [b"err1\n", b"err2\n", b"err3\n", b"err4\n"]
        big = os.memfd_create("big")
        out = runner.run(Task(exec={"argv": ["head", "-c", "3000000", "/dev/zero"]},
                              stdio={"stdout": big}))
        assert out.ok and os.fstat(big).st_size == 3_000_000
    finally:
        runner.close()
        link.close()
    assert link.proc.returncode is not None


def test_an_untrusted_server_uid_and_a_missing_socket_are_refused(site: Site,
                                                                  tmp_path: object) -> None:
    link = local_link(str(site.socket), [os.getuid() + 4242])
    try:
        with pytest.raises(UntrustedServer):
            link.open(5)
    finally:
        link.close()
    link = local_link(f"{tmp_path}/absent.sock")
    try:
        with pytest.raises(Unreachable) as caught:
            link.open(5)
        assert isinstance(caught.value.__cause__, FileNotFoundError)
    finally:
        link.close()


def test_a_dead_relay_ends_the_running_tasks_and_every_later_open(site: Site) -> None:
    link = local_link(str(site.socket))
    runner = TaskRunner("here:fiberd", opener=link.open)
    try:
        import threading

        outcome: list[object] = []
        th = threading.Thread(target=lambda: outcome.append(
            runner.run(Task(exec={"argv": ["sleep", "30"]}))))
        th.start()
        while not runner._running:  # the fiber started
            th.join(0.05)
        link.proc.kill()
        th.join(30)
        assert not th.is_alive()
        (end,) = outcome
        assert end.failure is not None and not end.refused, end  # type: ignore[attr-defined]
        with pytest.raises(Unreachable):
            link.open(5)
    finally:
        runner.close()
        link.close()
