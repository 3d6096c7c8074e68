"""Every job's fiberd on a Slurm node, scraped through the node's own node_exporter.

Each job on a node has its own fiberd, run by the job's user. node_exporter must
not read files a job user can write: a FIFO named ``*.prom`` in its textfile
directory stalls every scrape of the node (checked with Debian 12's node_exporter
1.5), and a user could write any sample for any job. So one relay per node, run
by root (``slurm-fiber node-metrics``, contrib/systemd), collects them:

- for each job dir ``<state root>/nodes/<node>/jobs/<id>/`` (found with
  ``lstat``: a link is skipped), a child process running as the dir's owner
  (the job's user: no supplementary groups, ``no_new_privs``) asks the job's
  fiberd for its ``metrics`` over the job's socket, within ``timeout``, and
  passes at most ``MAX_BYTES`` back through a pipe. Root never opens or
  connects to a path below a directory a job user owns; the child is killed
  if it overruns;
- root parses the text (prometheus-client's parser), keeps only
  ``slurm_fiber_*`` families and at most ``MAX_SAMPLES`` samples, sets the
  labels ``home``, ``job_id`` and ``node`` from the directory it found (a job's
  own labels of those names are replaced), and writes
  ``slurm_fiber_job_<id>.prom`` atomically (``safefs.write_atomic``) into
  ``<state root>/nodes/<node>/metrics/`` (root's, 0755), with
  ``slurm_fiber_relay.prom``: ``slurm_fiber_relay_job_up{job_id,node}`` (1
  answered, 0 not) and when the relay last ran;
- a job whose fiberd did not answer has no file (its old one is removed), and
  the files of jobs that have no job dir any more are removed; the epilog
  removes its job's file at once (``remove_job_textfile``).

node_exporter reads them with ``--collector.textfile.directory=<state
root>/nodes/*/metrics`` (a glob; node_exporter 1.5 takes one). What a job's
samples say is the job user's word (they run their fiberd); only which job and
node they are labelled with is the relay's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import signal
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_fiber import safefs
from slurm_fiber.defaults import SOCKET_NAME
from slurm_fiber.homes.slurm.paths import node_dir

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

log = logging.getLogger("slurm_fiber.nodemetrics")

METRICS_DIR = "metrics"
RELAY_FILE = "slurm_fiber_relay.prom"
MAX_BYTES = 1 << 20  # of one job's exposition
MAX_SAMPLES = 5000  # of one job's samples kept
PREFIX = "slurm_fiber_"
TIMEOUT = 2.0  # seconds one job's fiberd has to answer
_JOB_FILE = re.compile(r"slurm_fiber_job_(\d+)\.prom")


def metrics_dir(state_root: str | os.PathLike[str], node: str) -> Path:
    """Where the relay writes ``node``'s files (root's; node_exporter reads it)."""
    return node_dir(state_root, node) / METRICS_DIR


def job_textfile_name(job_id: int) -> str:
    return f"slurm_fiber_job_{job_id}.prom"


def remove_job_textfile(state_root: str | os.PathLike[str], node: str, job_id: int) -> bool:
    """Remove job ``job_id``'s file (the epilog's one call); False when there was none.
    Raises OSError (UnsafePath) when the metrics dir is not root's alone."""
    try:
        dir_fd = safefs.open_dir(metrics_dir(state_root, node))
    except FileNotFoundError:
        return False
    try:
        os.unlink(job_textfile_name(job_id), dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dir_fd)


@dataclass(frozen=True)
class JobDir:
    """A job dir found on the node: its id, path and owner."""

    job_id: int
    path: Path
    uid: int
    gid: int


def job_dirs(state_root: str | os.PathLike[str], node: str) -> Iterator[JobDir]:
    """The node's job dirs (by ``lstat``: links, non-dirs and non-numeric names skipped)."""
    jobs = node_dir(state_root, node) / "jobs"
    try:
        names = os.listdir(jobs)
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in sorted(names):
        if not name.isdigit():
            continue
        path = jobs / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            yield JobDir(int(name), path, st.st_uid, st.st_gid)


def fetch_as_owner(job: JobDir, timeout: float = TIMEOUT) -> bytes | None:
    """The job's fiberd's exposition, asked by a child running as the job dir's owner;
    None when it did not answer within ``timeout`` (the child is then killed)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(read_end)
            code = _child(job, write_end, timeout)
        finally:
            os._exit(code)
    os.close(write_end)
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + timeout + 0.5
    try:
        while size <= MAX_BYTES:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                return None  # overran: killed below
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(read_end)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if size > MAX_BYTES or not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return None
    return b"".join(chunks)


def _child(job: JobDir, out: int, timeout: float) -> int:
    """In the forked child: become the job dir's owner, ask its fiberd, write the text."""
    import socket

    from slurm_fiber.protocol.framing import FrameDecoder, encode_frame
    from slurm_fiber.protocol.limits import MAX_REPLY
    from slurm_fiber.protocol.replies import Metrics as MetricsReply
    from slurm_fiber.protocol.requests import Metrics

    os.setgroups([])
    os.setgid(job.gid)
    os.setuid(job.uid)
    _no_new_privs()
    os.chdir(job.path)  # as the owner: a link there is the owner's own business
    signal.alarm(int(timeout) + 1)
    decoder = FrameDecoder(MAX_REPLY)  # one request, one reply: the protocol's own framing
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(SOCKET_NAME)
        sock.sendall(encode_frame(Metrics().to_json(1)))
        while (frame := decoder.next_frame()) is None:
            chunk = sock.recv(65536)
            if not chunk:
                return 1
            decoder.feed(chunk)
    reply = frame.body
    if not isinstance(reply, dict) or not reply.get("ok") or not isinstance(
            reply.get("result"), dict):
        return 1
    data = MetricsReply.from_json(reply["result"]).text.encode()[:MAX_BYTES + 1]
    view = memoryview(data)
    while view:
        view = view[os.write(out, view):]
    return 0


def _no_new_privs() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_no_new_privs = 38
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def relabel(text: str, job_id: int, node: str) -> str:
    """``text``'s ``slurm_fiber_*`` families (at most MAX_SAMPLES samples) with ``home``,
    ``job_id`` and ``node`` set by the relay, in the text format. Raises ValueError for
    text that does not parse."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: list[Metric] = []
    kept = 0
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIX) or family.name.startswith(PREFIX + "relay"):
            continue
        if kept >= MAX_SAMPLES:
            break
        samples = family.samples[:MAX_SAMPLES - kept]
        kept += len(samples)
        family.samples = [Sample(s.name, {**s.labels, "home": "slurm", "job_id": str(job_id),
                                          "node": node}, s.value) for s in samples]
        families.append(family)

    class Parsed:
        def collect(self) -> list[Metric]:
            return families

    return generate_latest(Parsed()).decode() if families else ""


@dataclass(frozen=True)
class RelayRun:
    """What one pass over a node did: the jobs answered and those that did not."""

    node: str
    up: tuple[int, ...]
    down: tuple[int, ...]
    removed: tuple[str, ...]


def relay_node(state_root: str | os.PathLike[str], node: str,
               timeout: float = TIMEOUT) -> RelayRun:
    """One pass over ``node``: a file per answering job, stale files removed, the relay's
    own file. Raises OSError (UnsafePath) when the metrics dir cannot be made root's."""
    where = metrics_dir(state_root, node)
    dir_fd = safefs.open_dir(where, create_mode=0o755)
    up: list[int] = []
    down: list[int] = []
    try:
        for job in job_dirs(state_root, node):
            raw = fetch_as_owner(job, timeout)
            text = None
            if raw is not None:
                try:
                    text = relabel(raw.decode("utf-8", "replace"), job.job_id, node)
                except ValueError as err:
                    log.warning("job %d's metrics do not parse: %s", job.job_id, err)
            if text:
                safefs.write_atomic(dir_fd, job_textfile_name(job.job_id), text.encode())
                up.append(job.job_id)
            else:
                down.append(job.job_id)
        removed = _remove_stale(dir_fd, set(up))
        safefs.write_atomic(dir_fd, RELAY_FILE, _relay_text(node, up, down).encode())
    finally:
        os.close(dir_fd)
    return RelayRun(node, tuple(up), tuple(down), tuple(removed))


def _remove_stale(dir_fd: int, current: set[int]) -> list[str]:
    removed = []
    for name in os.listdir(dir_fd):
        found = _JOB_FILE.fullmatch(name)
        if found and int(found.group(1)) not in current:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
                removed.append(name)
    return removed


def _relay_text(node: str, up: list[int], down: list[int]) -> str:
    lines = [
        "# HELP slurm_fiber_relay_job_up Whether the job's fiberd answered the node's relay.",
        "# TYPE slurm_fiber_relay_job_up gauge",
        *(f'slurm_fiber_relay_job_up{{job_id="{j}",node="{node}"}} 1' for j in up),
        *(f'slurm_fiber_relay_job_up{{job_id="{j}",node="{node}"}} 0' for j in down),
        "# HELP slurm_fiber_relay_last_run_seconds When the node's relay last ran (Unix time).",
        "# TYPE slurm_fiber_relay_last_run_seconds gauge",
        f'slurm_fiber_relay_last_run_seconds{{node="{node}"}} {time.time():.3f}',
    ]
    return "\n".join(lines) + "\n"


def nodes(state_root: str | os.PathLike[str]) -> list[str]:
    """The node names under the state root (several slurmd may share a host)."""
    try:
        return sorted(name for name in os.listdir(Path(state_root) / "nodes")
                      if (Path(state_root) / "nodes" / name).is_dir())
    except FileNotFoundError:
        return []
