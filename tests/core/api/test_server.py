"""The socket server against a real-process Service: ops, streams, refusals, peers, timeouts."""

from __future__ import annotations

import math
import os
import struct
import tempfile
from pathlib import Path

import pytest

from slurm_fiber.client.connection import FiberdClient, Missed, Refused, Unreachable
from slurm_fiber.core.clock import SystemClock
from tests.core.api.rawkit import raw_exchange
from tests.core.api.servicekit import serve


def test_plain_ops_answer(served) -> None:
    with FiberdClient(served.path) as c:
        assert c.request("status")["home"] == "test"
        assert c.request("health")["state"] == "fresh"
        assert c.request("ready") == {"ready": True}
        assert c.request("list_grants")["grants"][0]["uid"] == "g1"
        assert c.request("list_fibers") == {"fibers": []}


def test_socket_is_owner_only(served) -> None:
    assert os.stat(served.path).st_mode & 0o777 == 0o600


def test_exec_clone_streams_started_then_exit_with_status(served, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with open(out, "wb") as sink, FiberdClient(served.path) as c:
        fiber = c.clone(exec={"argv": ["sh", "-c", "echo hello; pwd; exit 3"],
                              "cwd": str(tmp_path)},
                        stdio={"stdout": sink.fileno()}, wait=True)
        assert fiber["pid"] > 0
        end = c.wait_exit()
    assert (end["exit_code"], end["signal"], end["status"]) == (3, None, 3)
    assert set(end["rusage"]) >= {"utime", "stime", "maxrss_kib"}
    assert out.read_text() == f"hello\n{tmp_path}\n"


def test_call_clone_returns_result_or_error(served) -> None:
    with FiberdClient(served.path) as c:
        c.clone(call={"target": "math:fsum", "args": [[0.5, 0.25]]}, wait=True)
        assert c.wait_exit()["result"] == 0.75
    with pytest.raises(ValueError) as here:  # its wording changes between Pythons
        math.sqrt(-1)
    with FiberdClient(served.path) as c:
        c.clone(call={"target": "math:sqrt", "args": [-1]}, wait=True)
        assert c.wait_exit()["error"] == {"type": "ValueError", "message": str(here.value)}


def test_env_additions_reach_the_fiber_but_device_vars_are_refused(served, tmp_path) -> None:
    out = tmp_path / "env"
    with open(out, "wb") as sink, FiberdClient(served.path) as c:
        c.clone(exec={"argv": ["sh", "-c", "echo $GREETING"]}, env={"GREETING": "hi"},
                stdio={"stdout": sink.fileno()}, wait=True)
        c.wait_exit()
    assert out.read_text() == "hi\n"
    with FiberdClient(served.path) as c, pytest.raises(Refused) as e:
        c.clone(exec={"argv": ["true"]}, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert e.value.code == "bad_request" and "grant" in e.value.reason


def test_misses_carry_code_and_retryability(served) -> None:
    with FiberdClient(served.path) as c:
        with pytest.raises(Missed) as cold:
            c.clone(exec={"argv": ["true"]}, grant="cold-1")
        with pytest.raises(Missed) as gone:
            c.clone(exec={"argv": ["true"]}, grant="gone-1")
    assert (cold.value.code, cold.value.retryable, cold.value.miss["retry_after"]) == \
        ("cold", True, 0.5)
    assert (gone.value.code, gone.value.retryable) == ("unknown_grant", False)


def test_signal_inspect_stop_and_not_found(served) -> None:
    with FiberdClient(served.path) as c:
        fiber = c.clone(exec={"argv": ["sleep", "30"]})
        fid = fiber["id"]
        assert c.request("inspect_fiber", fiber=fid)["fiber"]["state"] == "running"
        assert c.request("signal_fiber", fiber=fid, signal="USR1") == {"delivered": True}
        stopped = c.request("stop_fiber", fiber=fid, grace=1)["fiber"]
        assert stopped["state"] == "exited"
        assert c.request("signal_fiber", fiber=fid, signal=15) == {"delivered": False}
        with pytest.raises(Refused) as e:
            c.request("inspect_fiber", fiber="nope")
    assert e.value.code == "not_found"
    assert served.service.fibers[fid].signals == [10]


def test_metrics_counts_clones_and_misses(served) -> None:
    with FiberdClient(served.path) as c:
        c.clone(exec={"argv": ["true"]}, wait=True)
        c.wait_exit()
        with pytest.raises(Missed):
            c.clone(exec={"argv": ["true"]}, grant="cold-x")
        text = c.request("metrics")["text"]
    assert 'slurm_fiber_clones_total{grant=""} 1.0' in text  # the test service names none
    assert 'slurm_fiber_clone_misses_total{code="cold"} 1.0' in text
    assert 'slurm_fiber_clone_misses_total{code="expired"} 0.0' in text
    assert "slurm_fiber_clone_latency_seconds_count 2.0" in text
    assert "slurm_fiber_fibers_running 0.0" in text


def test_service_failure_is_an_internal_error_and_the_server_carries_on(served) -> None:
    with FiberdClient(served.path) as c:
        with pytest.raises(Refused) as e:
            c.clone(exec={"argv": ["true"]}, grant="boom")
        assert e.value.code == "internal" and "the runtime broke" in e.value.reason
        assert c.request("ready") == {"ready": True}
    assert [r.code for r in served.refusals] == ["internal"]


def test_a_request_failing_for_want_of_descriptors_is_busy_not_internal(served) -> None:
    with FiberdClient(served.path) as c:
        with pytest.raises(Refused) as e:
            c.clone(exec={"argv": ["true"]}, grant="emfile")
        assert e.value.code == "busy" and "out of file descriptors" in e.value.reason
        assert c.request("ready") == {"ready": True}
    assert [r.code for r in served.refusals] == ["busy"]


@pytest.mark.parametrize(("message", "code"), [
    ({"op": "launch"}, "unknown_op"),
    ({"op": "status", "extra": 1}, "bad_request"),
    ({"op": "clone", "exec": {"argv": "ls"}}, "bad_request"),
    ({"op": "clone", "exec": {"argv": ["ls"]}, "call": {"target": "a:b"}}, "bad_request"),
    ({"op": "status", "v": 6}, "unsupported_version"),
    ([1, 2, 3], "bad_request"),
])
def test_bad_requests_get_error_replies_on_a_live_connection(served, message, code) -> None:
    with FiberdClient(served.path) as c:
        c.send({"id": 7, **message} if isinstance(message, dict) else message)  # type: ignore[arg-type]
        reply = c.receive()
        assert reply["ok"] is False and reply["error"]["code"] == code
        assert c.request("ready") == {"ready": True}  # same connection still serves


def test_not_json_then_oversize_frame(served) -> None:
    replies = raw_exchange(served.path, struct.pack(">I", 3) + b"{x]")
    assert replies[0]["error"]["code"] == "bad_frame"
    replies = raw_exchange(served.path, struct.pack(">I", 1 << 30) + b"xx")
    assert replies[0]["error"]["code"] == "frame_too_large"


def test_descriptors_only_on_clone_and_matching_stdio(served) -> None:
    r, w = os.pipe()
    try:
        with FiberdClient(served.path) as c:
            c.send({"op": "status"}, [w])
            assert c.receive()["error"]["code"] == "bad_fds"
            c.send({"op": "clone", "exec": {"argv": ["true"]}, "stdio": ["stdout"]}, [w, w])
            assert c.receive()["error"]["code"] == "bad_fds"
            c.send({"op": "clone", "exec": {"argv": ["true"]}}, [w, w, w, w, w])
            assert c.receive()["error"]["code"] == "bad_fds"
    finally:
        os.close(r)
        os.close(w)


def test_a_request_during_a_stream_is_busy_and_the_stream_completes(served) -> None:
    with FiberdClient(served.path) as c:
        c.clone(exec={"argv": ["sleep", "0.3"]}, wait=True)
        c.send({"op": "status", "id": "stray"})
        stray = c.receive()
        assert (stray["id"], stray["error"]["code"]) == ("stray", "busy")
        assert c.wait_exit()["status"] == 0


def test_client_leaving_a_waited_fiber_hangs_it_up(served) -> None:
    c = FiberdClient(served.path)
    fiber = c.clone(exec={"argv": ["sleep", "30"]}, wait=True)
    c.close()
    end = served.call(served.service.fibers[fiber["id"]].wait)
    assert end.signal == 1  # SIGHUP


def test_refused_peer_gets_forbidden_and_is_audited(tmp_path) -> None:
    with serve(tmp_path / "s.sock", SystemClock(), allowed_uids=frozenset({4242})) as s:
        with FiberdClient(s.path) as c, pytest.raises(Refused) as e:
            c.request("status")
        assert e.value.code == "forbidden"
        assert s.refusals[0].peer is not None and s.refusals[0].peer.uid == os.getuid()


@pytest.mark.machine_may_lack("needs root to connect as another uid")
def test_another_uid_is_refused_by_default() -> None:
    if os.getuid() != 0:
        pytest.skip("not root")
    where = Path(tempfile.mkdtemp(prefix="sockapi-"))
    where.chmod(0o755)  # nobody must reach the socket to be refused by fiberd, not by the fs
    with serve(where / "s.sock", SystemClock(), mode=0o666) as s:
        pid = os.fork()
        if pid == 0:  # child: become nobody, ask, report the code as exit status
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                with FiberdClient(s.path) as c:
                    c.request("status")
            except Refused as e:
                code = 0 if e.code == "forbidden" else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert s.refusals[0].code == "forbidden" and s.refusals[0].peer.uid == 65534
    where.rmdir()


def test_unreachable_when_no_server(tmp_path) -> None:
    with pytest.raises(Unreachable):
        FiberdClient(tmp_path / "absent.sock")
