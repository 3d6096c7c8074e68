"""A spare's order channel (core/fiber_setup.py ``await_order``), run in this process.

The channel ends closed when ``await_order`` returns, whether the order ran,
was refused or the spare was dismissed, and never through the socket's
finalizer (no ResourceWarning, whose formatting a fiber would pay for).
"""

from __future__ import annotations

import errno
import gc
import json
import os
import socket
import warnings

import pytest

from slurm_fiber.core.templates import wire
from slurm_fiber.core.templates.child.fiber_setup import (
    EXIT_EXEC,
    EXIT_NOT_RUNNABLE,
    EXIT_SETUP,
    ResultChannel,
    await_order,
    exec_order,
)


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as e:
        return e.errno == errno.EBADF
    return False


@pytest.mark.parametrize(("sent", "code"), [
    (wire.encode({"t": "run", "id": "f1"}), 5),  # run: the runner's code
    (wire.encode({"t": "nope"}), EXIT_SETUP),  # refused, with an error record
    (b"", 0),  # dismissed (end of file)
])
def test_the_channel_is_closed_on_return_without_a_resource_warning(sent: bytes, code: int):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = theirs.detach()
    ran: list[str] = []

    def run(order: wire.Message, stdio: list[int], result: ResultChannel) -> int:
        ran.append(str(order.get("id")))
        result.write('{"ok": true}')
        return 5

    with ours:
        if sent:
            ours.send(sent)
        else:
            ours.shutdown(socket.SHUT_WR)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert await_order(fd, {}, None, run) == code
            gc.collect()
        assert _closed(fd)
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert ran == (["f1"] if code == 5 else [])
        replies = []
        while data := ours.recv(wire.MAX_MESSAGE):
            replies.append(data)
    assert bool(replies) == (sent != b"")  # a record for a run or a refusal, none when dismissed


def test_descriptors_riding_with_the_order_reach_the_runner():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    got: list[list[int]] = []

    def run(order: wire.Message, stdio: list[int], result: ResultChannel) -> int:
        got.append(stdio)
        return 0

    with ours:
        socket.send_fds(ours, [wire.encode({"t": "run", "id": "f1"})], [w, r])
        assert await_order(theirs.detach(), {}, None, run) == 0
    (stdio,) = got
    try:
        assert len(stdio) == 2
        assert [os.fstat(fd).st_ino for fd in stdio] == [os.fstat(w).st_ino, os.fstat(r).st_ino]
    finally:
        for fd in (*stdio, r, w):
            os.close(fd)


def _exec_in_child(order: wire.Message) -> tuple[int, bytes, list[dict[str, object]]]:
    """Fork; the child runs ``exec_order`` with its stdout on a pipe: (wait status, what
    the program printed, the records the child wrote on its result channel)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            ours.close()
            os.close(r)
            code = exec_order(order, [w], ResultChannel(theirs))
        finally:
            os._exit(code)
    theirs.close()
    os.close(w)
    with os.fdopen(r, "rb") as out:
        printed = out.read()
    records = []
    with ours:
        while data := ours.recv(wire.MAX_MESSAGE):
            records.append(json.loads(data))
    _, status = os.waitpid(pid, 0)
    return status, printed, records


def test_an_exec_order_runs_its_argv_found_on_path_with_the_orders_env_and_cwd(tmp_path):
    script = tmp_path / "bin" / "show"
    script.parent.mkdir()
    script.write_text('#!/bin/sh\necho "$A|$SLURM_FIBER_ID|$KEPT|$(pwd)|$0|$1"\n')
    script.chmod(0o755)
    os.environ["KEPT"] = "from the spare"
    try:
        status, printed, records = _exec_in_child({
            "t": "run", "id": "f7", "mode": "exec", "argv": ["show", "x y"], "cwd": "/",
            "stdio": [False, True, False],
            "env": {"A": "1", "PATH": f"/nonexistent:{script.parent}:/bin"}})
    finally:
        del os.environ["KEPT"]
    assert os.waitstatus_to_exitcode(status) == 0
    assert printed == f"1|f7|from the spare|/|{script}|x y\n".encode()
    assert records == []
    assert "SLURM_FIBER_ID" not in os.environ  # the caller's environ is left alone


@pytest.mark.parametrize(("program", "code", "name"), [
    ("no-such-program-here", EXIT_EXEC, "ENOENT"),
    ("{tmp}/not-executable", EXIT_NOT_RUNNABLE, "EACCES"),
])
def test_an_exec_that_fails_writes_the_exec_failed_record_and_a_shells_code(
        tmp_path, program, code, name):
    (tmp_path / "not-executable").write_text("true\n")
    argv = [program.format(tmp=tmp_path)]
    status, _, records = _exec_in_child({"t": "run", "id": "f1", "mode": "exec",
                                               "argv": argv, "stdio": [False, True, False]})
    assert os.waitstatus_to_exitcode(status) == code
    (record,) = records
    assert record["ok"] is False
    assert record["exec_failed"]["name"] == name
    assert record["exec_failed"]["path"] == argv[0]


def test_a_directory_on_path_that_cannot_run_the_name_is_the_error_not_a_later_miss(tmp_path):
    (tmp_path / "prog").mkdir()  # found first, not runnable: as os.execvpe, EACCES wins
    status, _, records = _exec_in_child({"t": "run", "id": "f1", "mode": "exec",
                                         "argv": ["prog"], "stdio": [False, True, False],
                                         "env": {"PATH": f"{tmp_path}:/nonexistent"}})
    assert os.waitstatus_to_exitcode(status) == EXIT_NOT_RUNNABLE
    assert records[0]["exec_failed"]["name"] == "EACCES"


@pytest.mark.parametrize("order", [
    {"argv": []},
    {"argv": ["tr\0ue"]},
    {"argv": ["true"], "env": {"A=B": "1"}},
    {"argv": ["true"], "cwd": "/nonexistent/dir"},
])
def test_an_exec_order_that_cannot_be_set_up_is_an_error_record_not_a_crash(order):
    status, _, records = _exec_in_child({"t": "run", "id": "f1", "mode": "exec",
                                         "stdio": [False, True, False], **order})
    assert os.waitstatus_to_exitcode(status) == EXIT_SETUP
    (record,) = records
    assert record["ok"] is False and record["error"]["message"]


def test_a_written_record_ends_the_channel_at_once_though_the_fiber_holds_it_open():
    """fiberd takes the record as whole at end of file: the write ends the writing side,
    so that comes with the record, not when the fiber's process has finished exiting."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        record = "x" * (ResultChannel.CHUNK + 10)  # two datagrams
        ResultChannel(theirs).write(record)
        ours.settimeout(5)
        got = [ours.recv(65536), ours.recv(65536)]
        assert b"".join(got).decode() == record
        assert ours.recv(65536) == b""  # end of file, with ``theirs`` still open
        with pytest.raises(BrokenPipeError):
            ResultChannel(theirs).write("a second record")
