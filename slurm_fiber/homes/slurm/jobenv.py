"""A Slurm job read from its environment alone (prolog, epilog, batch script or step).

The prolog must not call slurmctld, so everything it knows about the job comes
from the variables slurmd sets. ``job_from_env`` turns them into a frozen
``SlurmJob`` with every field validated; a missing or malformed variable raises
``SlurmParseError`` with a code and one line naming the variable and what was
wrong. Nothing here does I/O. Free text the job's user controls (job name,
comment) never fails the parse: a value that is not printable is dropped.

Verified on Slurm 22.05 (fixtures in tests/homes/slurm/fixtures/env_22.05_*): the
prolog/epilog see SLURM_JOB_ID/UID/GID/USER/PARTITION, SLURMD_NODENAME,
SLURM_CLUSTER_NAME, SLURM_JOB_GPUS for GPU jobs, SLURM_JOB_ACCOUNT and
SLURM_JOB_COMMENT when set; no job name and no end time (SLURM_JOB_END_TIME is
read when a later release provides it). Batch scripts and steps also see
SLURM_JOB_NAME; steps with their own GRES see SLURM_STEP_GPUS. Slurm 26.05 adds
SLURM_JOB_SLUID everywhere (fixtures env_26.05_*), the job's SLUID, which names
its cgroup/v2 directory (cgroup_layout).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from slurm_fiber.defaults import NODE_RULE, is_node_name
from slurm_fiber.homes.slurm.names import SlurmParseError

MAX_ID = 2**32 - 2  # Slurm ids and Unix ids are uint32; the top values are sentinels
MAX_FREE_TEXT = 4096
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.+-]{1,128}")  # partition, cluster, account
USER_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")
RANGE_PATTERN = re.compile(r"(\d{1,6})(?:-(\d{1,6}))?")
MAX_INDICES = 1024
# A SLUID as Slurm 26.05 prints it (src/common/sluid.c print_sluid): "s" and 13 digits of
# Crockford's base32 (no I, L, O or U), most significant first.
SLUID_PATTERN = re.compile(r"s[0-9A-HJKMNP-TV-Z]{13}")

# Where a job's GPUs on this node are named, most specific first. The Slurm
# variables carry the node's indices; CUDA_VISIBLE_DEVICES may be renumbered
# when the site confines devices, so it is only the last resort.
GPU_VARS = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class SlurmJob:
    """One job as this node sees it. ``gpus`` are the node's GPU indices, sorted.

    ``gpu_source`` names the variable the GPUs came from (None when the job has
    none). ``end_time`` is Unix seconds when Slurm exported it, else None.
    ``sluid`` is the job's SLUID (Slurm 26.05+), else None. ``gpu_visible`` is, for each
    of ``gpus`` in order, the id this step's runtimes are given for it (its
    CUDA_VISIBLE_DEVICES entry, which Slurm renumbers from 0 under ConstrainDevices), or
    () when the environment does not pair them one to one (``visible_ids``).
    """

    job_id: int
    uid: int
    gid: int
    user: str
    partition: str
    node: str
    cluster: str
    gpus: tuple[int, ...] = ()
    gpu_source: str | None = None
    account: str | None = None
    name: str | None = None
    comment: str | None = None
    end_time: int | None = None
    sluid: str | None = None
    gpu_visible: tuple[str, ...] = ()


def visible_ids(env: Mapping[str, str], gpus: tuple[int, ...],
                source: str | None) -> tuple[str, ...]:
    """The step's CUDA_VISIBLE_DEVICES entries for ``gpus`` (the node's indices, sorted, from
    ``source``), paired in order; () unless the GPUs came from a Slurm variable and the
    step's CUDA_VISIBLE_DEVICES names exactly as many small decimal ids. Pure."""
    value = env.get("CUDA_VISIBLE_DEVICES", "")
    if source not in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS") or not gpus or not value:
        return ()
    ids = [part.strip() for part in value.split(",")]
    if len(ids) != len(gpus) or not all(i.isascii() and i.isdigit() and len(i) <= 6
                                        for i in ids):
        return ()
    return tuple(ids)


def parse_index_list(text: str, what: str) -> tuple[int, ...]:
    """Parse "0,1", "0-3" or "0,2-3" into sorted unique indices; "" gives ().

    ``what`` names the source in the error. Raises SlurmParseError("invalid")
    for anything else, for a descending range, or for more than MAX_INDICES.
    """
    text = text.strip()
    if not text:
        return ()
    found: set[int] = set()
    for part in text.split(","):
        match = RANGE_PATTERN.fullmatch(part.strip())
        if match is None:
            raise SlurmParseError("invalid", f"{what}={text!r} is not an index list like 0,2-3")
        low = int(match.group(1))
        high = int(match.group(2) or low)
        if high < low or high - low >= MAX_INDICES or len(found) >= MAX_INDICES:
            raise SlurmParseError("invalid", f"{what}={text!r} has a bad or oversized range")
        found.update(range(low, high + 1))
    if len(found) > MAX_INDICES:
        raise SlurmParseError("invalid", f"{what}={text!r} names over {MAX_INDICES} devices")
    return tuple(sorted(found))


def parse_id(text: str, what: str, *, allow_zero: bool = True) -> int:
    """A uint32 id written in decimal digits (job id, uid, gid). Raises SlurmParseError."""
    if not text.isascii() or not text.isdigit() or len(text) > 10:
        raise SlurmParseError("invalid", f"{what}={text!r} is not a decimal id")
    value = int(text)
    if value > MAX_ID or (value == 0 and not allow_zero):
        raise SlurmParseError("invalid", f"{what}={text!r} is out of range")
    return value


def _required(env: Mapping[str, str], var: str) -> str:
    value = env.get(var)
    if value is None or value == "":
        raise SlurmParseError("missing", f"{var} is not set: not running under Slurm for a job?")
    return value


def _name(env: Mapping[str, str], var: str, pattern: re.Pattern[str]) -> str:
    value = _required(env, var)
    if not pattern.fullmatch(value):
        raise SlurmParseError("invalid", f"{var}={value[:80]!r} is not a valid name")
    return value


def _node(env: Mapping[str, str]) -> str:
    value = _required(env, "SLURMD_NODENAME")
    if not is_node_name(value):
        raise SlurmParseError("invalid",
                              f"SLURMD_NODENAME={value[:80]!r} is not a node name ({NODE_RULE})")
    return value


def _optional_name(env: Mapping[str, str], var: str) -> str | None:
    return _name(env, var, NAME_PATTERN) if env.get(var) else None


def _free_text(env: Mapping[str, str], var: str) -> str | None:
    value = env.get(var)
    if not value or len(value) > MAX_FREE_TEXT or not value.isprintable():
        return None
    return value


def _gpus(env: Mapping[str, str]) -> tuple[tuple[int, ...], str | None]:
    for var in GPU_VARS:
        value = env.get(var)
        if value is not None and value.strip():
            return parse_index_list(value, var), var
    return (), None


def job_from_env(env: Mapping[str, str]) -> SlurmJob:
    """The job described by ``env`` (pass ``os.environ`` or a prolog's environment).

    Pure and non-blocking. Raises SlurmParseError ("missing" or "invalid") for
    the first required variable that is absent or malformed.
    """
    gpus, gpu_source = _gpus(env)
    end_time = env.get("SLURM_JOB_END_TIME")
    sluid = env.get("SLURM_JOB_SLUID")
    return SlurmJob(
        job_id=parse_id(_required(env, "SLURM_JOB_ID"), "SLURM_JOB_ID", allow_zero=False),
        uid=parse_id(_required(env, "SLURM_JOB_UID"), "SLURM_JOB_UID"),
        gid=parse_id(_required(env, "SLURM_JOB_GID"), "SLURM_JOB_GID"),
        user=_name(env, "SLURM_JOB_USER", USER_PATTERN),
        partition=_name(env, "SLURM_JOB_PARTITION", NAME_PATTERN),
        node=_node(env),
        cluster=_name(env, "SLURM_CLUSTER_NAME", NAME_PATTERN),
        gpus=gpus,
        gpu_source=gpu_source,
        account=_optional_name(env, "SLURM_JOB_ACCOUNT"),
        name=_free_text(env, "SLURM_JOB_NAME"),
        comment=_free_text(env, "SLURM_JOB_COMMENT"),
        end_time=parse_id(end_time, "SLURM_JOB_END_TIME") if end_time else None,
        sluid=_name(env, "SLURM_JOB_SLUID", SLUID_PATTERN) if sluid else None,
        gpu_visible=visible_ids(env, gpus, gpu_source),
    )
