"""The grant tokens the prolog places in a job's grantdir: minted here, or imported from a spool.

- Minted (the site sets ``issuer`` and ``issuer_key``): one token, UID (sub)
  ``job-<id>``, audience ``slurm:<cluster>:<id>`` (``job_audience``), issued
  now and ending at the job's end (``SLURM_JOB_END_TIME`` when Slurm
  exports it, else ``token_lifetime`` from now; the epilog removes it at the
  job's end either way), carrying the site's ``grant`` spec. File
  ``job-<id>.jwt``.
- Imported (the site sets ``spool_dir``): every ``*.jwt`` a control plane
  dropped in ``<spool_dir>/<cluster>/<id>/``, verified first with the site's
  trust table for the job's audience; an invalid one is skipped with a
  one-line reason. Each file is judged alone: nothing one file holds (a
  FIFO, a directory, a hostile number, any verifier failure) can stop the
  others from being imported. File ``spool-<name>.jwt``, so it never
  replaces the minted one.

Everything here is a pure function of the config, the job and the clock,
except reading the key and the spool (small, bounded, link-free reads; every
directory from "/" to the job's spool dir must be root's or the spool's owner's
and writable by no one else, safefs.open_dir).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from slurm_fiber.core.clock import Clock
from slurm_fiber.core.trust.issuers import TrustStore
from slurm_fiber.core.trust.mint import load_private_key, mint
from slurm_fiber.core.trust.tokens import MAX_TOKEN_BYTES, TokenRefused, TokenVerifier
from slurm_fiber.homes.slurm.jobenv import SlurmJob
from slurm_fiber.homes.slurm.siteconfig import SiteConfig
from slurm_fiber.safefs import open_dir, read_file

SPOOL_NAME = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,99})\.jwt")
MAX_SPOOL_FILES = 64


@dataclass(frozen=True)
class TokenFile:
    """A token to place in the grantdir as ``name``."""

    name: str
    data: bytes


def job_audience(job: SlurmJob) -> str:
    """The audience of ``job``'s tokens: ``slurm:<cluster>:<job id>``."""
    return f"slurm:{job.cluster}:{job.job_id}"


def job_grant_uid(job: SlurmJob) -> str:
    """The UID (sub) of the token the prolog mints for ``job``."""
    return f"job-{job.job_id}"


def mint_job_token(config: SiteConfig, job: SlurmJob, clock: Clock) -> TokenFile:
    """Sign ``job``'s token with the site key. Raises ValueError/OSError (one line) on failure.

    Blocks on reading the key file.
    """
    if config.issuer_key is None:
        raise ValueError("the site config names no issuer_key")
    now = clock.wall()
    end = job.end_time if job.end_time is not None else now + config.token_lifetime
    if end <= now:
        raise ValueError(f"the job's end time {end} has passed; nothing to mint")
    key = load_private_key(config.issuer_key)
    token = mint(key, issuer=config.issuer, uid=job_grant_uid(job),
                 audience=job_audience(job), iat=now, exp=end, spec=config.grant)
    return TokenFile(f"{job_grant_uid(job)}.jwt", token.encode())


def spool_dir(config: SiteConfig, job: SlurmJob) -> Path | None:
    """Where a control plane drops ``job``'s tokens, or None when the site has no spool."""
    if config.spool_dir is None:
        return None
    return config.spool_dir / job.cluster / str(job.job_id)


def _judge(verifier: TokenVerifier, dir_fd: int, name: str) -> bytes | str:
    """The bytes of the token ``name`` in the spool dir ``dir_fd`` if it verifies, else a
    one-line reason it is skipped. Read with ``safefs.read_file``: a link, FIFO, hard
    link, directory or oversized file is refused without blocking.

    Never raises: a spooled file is untrusted input, and whatever is wrong with
    it must cost that file alone, not the job's other tokens.
    """
    try:
        data = read_file(dir_fd, name, max_bytes=MAX_TOKEN_BYTES)
        verifier.verify(data)
    except TokenRefused as err:
        return f"{err.reason}: {err.detail}"
    except OSError as err:
        return err.strerror or str(err)
    except ValueError as err:
        return str(err)
    except Exception as err:  # a verifier defect must not drop the other tokens
        return f"could not be checked ({type(err).__name__}: {err})"
    return data


def spooled_tokens(config: SiteConfig, job: SlurmJob,
                   clock: Clock) -> tuple[list[TokenFile], list[str]]:
    """The job's spooled tokens that verify, and one line per file skipped.

    A missing spool directory gives nothing and no complaint. Raises OSError
    only when the directory exists but cannot be listed.
    """

    where = spool_dir(config, job)
    if where is None:
        return [], []
    try:  # the spool's own owner (root or the control plane's account) and root, no one else
        dir_fd = open_dir(where, trusted_owners=(os.stat(where.parents[1]).st_uid,))
    except FileNotFoundError:
        return [], []
    try:
        return _judge_all(config, job, clock, where, dir_fd)
    finally:
        os.close(dir_fd)


def _judge_all(config: SiteConfig, job: SlurmJob, clock: Clock, where: Path,
               dir_fd: int) -> tuple[list[TokenFile], list[str]]:
    """``spooled_tokens`` for the opened spool dir ``dir_fd`` (shown as ``where``)."""
    names = sorted(n for n in os.listdir(dir_fd) if not n.startswith("."))  # not temp files
    problems: list[str] = []
    trust = TrustStore(config.trust, on_problem=problems.append)
    verifier = TokenVerifier(trust, job_audience(job), clock)
    found: list[TokenFile] = []
    for name in names[:MAX_SPOOL_FILES]:
        match = SPOOL_NAME.fullmatch(name)
        if match is None:
            if not name.startswith("."):
                problems.append(f"{where / name}: skipped, not a <name>.jwt file")
            continue
        judged = _judge(verifier, dir_fd, name)
        if isinstance(judged, str):
            problems.append(f"{where / name}: skipped, {' '.join(judged.split())}")
            continue
        found.append(TokenFile(f"spool-{match.group(1)}.jwt", judged))
    if len(names) > MAX_SPOOL_FILES:
        problems.append(f"{where}: only the first {MAX_SPOOL_FILES} files were read")
    return found, problems
