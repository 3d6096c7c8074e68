"""The Slurm control plane as the Slurm home asks it: ping, one job's state, a job's comment.

``ControlPlane`` is the interface; ``CliControl`` (the default) runs
`scontrol ping`, `squeue --json` and `scontrol update`, each bounded by a
subprocess timeout and killed (and reaped) when it runs over or its caller
is cancelled. The job's state comes from `squeue --json`, never from
`scontrol -o show job`, whose Key=Value line a user's Comment can spoof.

Failures raise ``ControlPlaneError`` (code and one-line reason); Slurm
output that cannot be used raises SlurmParseError from the parsers.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from slurm_fiber.errors import CodedError
from slurm_fiber.homes.slurm.jobenv import SlurmParseError
from slurm_fiber.homes.slurm.scontrol import Ping, QueueJob, parse_ping, parse_squeue_json

DEFAULT_TIMEOUT = 5.0
MAX_OUTPUT_LINE = 200
UNKNOWN_JOB = "Invalid job id"


class ControlPlaneError(CodedError):
    """A control-plane call failed: ``code`` (timeout, exec_failed, exit_status) and ``reason``."""


class ControlPlane(Protocol):
    """What the Slurm home asks slurmctld. Every method blocks its task, never the loop."""

    async def ping(self) -> Ping:
        """Ask whether slurmctld answers. Raises ControlPlaneError or SlurmParseError."""
        ...

    async def job(self, job_id: int) -> QueueJob | None:
        """The job as slurmctld lists it, None when it no longer lists it.

        Raises ControlPlaneError or SlurmParseError (e.g. "slurm_error" while
        slurmctld is unreachable).
        """
        ...

    async def set_comment(self, job_id: int, comment: str) -> None:
        """Set the job's Comment. Raises ControlPlaneError when Slurm refuses."""
        ...


@dataclass(frozen=True)
class Output:
    """What a finished command printed, and its exit code."""

    returncode: int
    stdout: str
    stderr: str


def first_line(text: str) -> str:
    """The first non-empty line of ``text``, cut to one short line ("" when none)."""
    return next((line.strip()[:MAX_OUTPUT_LINE] for line in text.splitlines() if line.strip()), "")


async def run_bounded(argv: Sequence[str], env: Mapping[str, str] | None,
                      timeout: float) -> Output:
    """Run ``argv`` to completion within ``timeout`` seconds (real time) and return its output.

    Blocks the calling task. On a timeout the process is killed and reaped
    and ControlPlaneError("timeout") is raised; when the caller is cancelled
    the process is killed and reaped before the cancellation propagates. A
    command that cannot start raises ControlPlaneError("exec_failed").
    """
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=None if env is None else dict(env), start_new_session=True)
    except OSError as err:
        raise ControlPlaneError("exec_failed", f"{argv[0]}: {err.strerror}") from None
    try:
        out, errs = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException as exc:
        if proc.returncode is None:
            proc.kill()
        await asyncio.shield(proc.wait())
        if isinstance(exc, TimeoutError):
            raise ControlPlaneError(
                "timeout", f"{' '.join(argv[:2])} gave no answer within {timeout:g} s"
            ) from None
        raise
    return Output(proc.returncode or 0, out.decode(errors="replace"), errs.decode(errors="replace"))


class CliControl:
    """The control plane through Slurm's commands (the default backend).

    ``env`` is the commands' environment (it must carry SLURM_CONF when the
    cluster's config is not the system's; None: this process's), ``timeout``
    bounds each command. Safe to share between tasks.
    """

    def __init__(self, env: Mapping[str, str] | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        if timeout <= 0:
            raise ValueError("the command timeout must be a positive number of seconds")
        self.env = env
        self.timeout = timeout

    async def ping(self) -> Ping:
        out = await run_bounded(["scontrol", "ping"], self.env, self.timeout)
        return parse_ping(out.stdout + out.stderr, out.returncode)

    async def job(self, job_id: int) -> QueueJob | None:
        # 22.05 ignores --jobs with --json (the parser filters); later releases honour it, and
        # 24.11+ then omit an ended job unless --states=all (recorded fixtures, 22.05-26.05).
        out = await run_bounded(["squeue", "--json", f"--jobs={job_id}", "--states=all"],
                                self.env, self.timeout)
        if UNKNOWN_JOB in out.stderr:
            return None
        if out.returncode != 0 and not out.stdout.strip():
            raise ControlPlaneError(
                "exit_status", f"squeue exited {out.returncode}: {first_line(out.stderr)}")
        try:
            return parse_squeue_json(out.stdout, job_id)
        except SlurmParseError as err:
            if UNKNOWN_JOB in err.reason:
                return None
            raise

    async def set_comment(self, job_id: int, comment: str) -> None:
        argv = ["scontrol", "update", f"JobId={job_id}", f"Comment={comment}"]
        out = await run_bounded(argv, self.env, self.timeout)
        if out.returncode != 0:
            reason = first_line(out.stderr) or first_line(out.stdout) or "no message"
            raise ControlPlaneError(
                "exit_status", f"scontrol update JobId={job_id} exited {out.returncode}: {reason}")
