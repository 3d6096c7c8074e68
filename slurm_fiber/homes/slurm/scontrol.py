"""Parsers for Slurm command output: `scontrol -o show job`, `scontrol ping`, `squeue --json`.

Pure functions of the command's text (and exit code); the caller runs the
command. Tolerant of Slurm 22.05 through 25.x (fixtures in tests/homes/slurm/fixtures:
22.05 recorded from a real cluster, later formats written by hand from Slurm's
documentation and source, each file says which). Hostile input never crashes a
parser: it raises SlurmParseError with a code and a one-line reason.

`scontrol -o show job` prints Key=Value pairs on one line, and values may
contain spaces (Comment, Command with arguments, JobName, WorkDir), so a
user's comment can look like more pairs. A key that appears twice is reported
as ambiguous rather than guessed; where a job's state must be trusted, prefer
`squeue --json`, whose JSON cannot be spoofed that way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from slurm_fiber.homes.slurm.jobenv import SlurmParseError, parse_id, parse_index_list

KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")
# `-d` adds one group of these per set of nodes with the same allocation.
NODE_DETAIL_KEYS = frozenset({"Nodes", "CPU_IDs", "Mem", "GRES"})
GPU_GRES = re.compile(r"gpu(?::[^:(,\s]+)?:\d+\(IDX:([0-9,\-]*|N/A)\)")
PING_LINE = re.compile(r"Slurmctld\((\w+)\) at (\S+) is (UP|DOWN)")
HOSTLIST_GROUP = re.compile(r"^([^\[]*)\[([^\]]+)\](.*)$")
MAX_HOSTS = 65536


def expand_hostlist(text: str) -> tuple[str, ...]:
    """Expand a Slurm hostlist ("n[1-2],gpu[01-03]x") into names, keeping zero padding.

    Raises SlurmParseError("invalid") for unbalanced brackets or over MAX_HOSTS names.
    """
    names: list[str] = []
    for item in _split_top_level(text):
        names.extend(_expand_one(item))
        if len(names) > MAX_HOSTS:
            raise SlurmParseError("invalid", f"hostlist {text[:60]!r} names too many hosts")
    return tuple(names)


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise SlurmParseError("invalid", f"hostlist {text[:60]!r} has unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise SlurmParseError("invalid", f"hostlist {text[:60]!r} has unbalanced brackets")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(item: str) -> list[str]:
    match = HOSTLIST_GROUP.match(item)
    if match is None:
        return [item]
    prefix, ranges, rest = match.groups()
    out: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise SlurmParseError("invalid", f"hostlist range {part!r} is not numeric")
        first, last = int(low), int(high or low)
        if last < first or last - first > MAX_HOSTS:
            raise SlurmParseError("invalid", f"hostlist range {part!r} is reversed or too large")
        out.extend(f"{prefix}{n:0{len(low)}d}" for n in range(first, last + 1))
    return [name + tail for name in out for tail in _expand_one(rest)] if rest else out


def gpu_indices_from_gres(detail: str) -> tuple[int, ...]:
    """GPU indices in GRES detail text: "gpu:2(IDX:0-1)" or "gpu:a100:1(IDX:3),..."."""
    found: set[int] = set()
    for match in GPU_GRES.finditer(detail):
        if match.group(1) != "N/A":
            found.update(parse_index_list(match.group(1), "GRES IDX"))
    return tuple(sorted(found))


@dataclass(frozen=True)
class NodeDetail:
    """One `-d` allocation group: the nodes it covers and their GPU indices."""

    nodes: tuple[str, ...]
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class ShowJob:
    """One record of `scontrol -o show job`.

    ``fields`` holds every key seen exactly once; ``ambiguous`` the keys seen
    more than once (their values are not trusted). ``node_details`` is filled
    only for `scontrol -d`.
    """

    fields: Mapping[str, str]
    ambiguous: frozenset[str] = frozenset()
    node_details: tuple[NodeDetail, ...] = ()

    def get(self, key: str) -> str | None:
        """The value of ``key``, None when absent; SlurmParseError("ambiguous") if repeated."""
        if key in self.ambiguous:
            raise SlurmParseError("ambiguous", f"{key}= appears more than once in show job output")
        return self.fields.get(key)

    @property
    def job_id(self) -> int:
        return parse_id(self.get("JobId") or "", "JobId", allow_zero=False)

    @property
    def state(self) -> str:
        """The base job state, e.g. RUNNING or COMPLETED."""
        value = self.get("JobState")
        if not value:
            raise SlurmParseError("missing", "show job output has no JobState")
        return value.split()[0].upper()

    def gpus_on(self, node: str) -> tuple[int, ...]:
        """GPU indices the job holds on ``node`` (needs `scontrol -d` output).

        Raises SlurmParseError("ambiguous") when text elsewhere posed as node details.
        """
        self.get("Nodes")
        return tuple(sorted({i for d in self.node_details if node in d.nodes for i in d.gpus}))


def _pairs(line: str) -> list[tuple[str, str]]:
    matches = list(KEY.finditer(line))
    if not matches:
        return []
    return [
        (m.group(1), line[m.end(): nxt.start() if nxt else len(line)].strip())
        for m, nxt in zip(matches, [*matches[1:], None], strict=True)
    ]


def _record(line: str) -> ShowJob:
    fields: dict[str, str] = {}
    repeated: set[str] = set()
    groups: list[dict[str, str]] = []
    blocks = 0  # runs of detail groups; a second run means text is posing as details
    in_block = False
    for key, value in _pairs(line):
        if key == "Nodes" or (key in NODE_DETAIL_KEYS and in_block):
            if not in_block:
                blocks += 1
            in_block = True
            if key == "Nodes":
                groups.append({})
            groups[-1][key] = value
            continue
        in_block = False
        if key in fields:
            repeated.add(key)
        fields[key] = value
    for key in repeated:
        del fields[key]
    if blocks > 1:
        return ShowJob(MappingProxyType(fields), frozenset(repeated | {"Nodes"}))
    details = tuple(
        NodeDetail(expand_hostlist(g["Nodes"]), gpu_indices_from_gres(g.get("GRES", "")))
        for g in groups
    )
    return ShowJob(MappingProxyType(fields), frozenset(repeated), details)


def parse_show_job(text: str, job_id: int) -> ShowJob:
    """The record for ``job_id`` in `scontrol [-d] -o show job N` output.

    Several records (a heterogeneous job) are allowed; the one whose JobId is
    ``job_id`` is returned. Raises SlurmParseError: "slurm_error" for Slurm's
    own error text (e.g. "Invalid job id specified"), "missing" when no record
    matches, "ambiguous" when the JobId itself is repeated.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise SlurmParseError("missing", f"scontrol printed nothing for job {job_id}")
    if not lines[0].startswith("JobId="):
        raise SlurmParseError("slurm_error", f"scontrol: {lines[0].strip()[:200]}")
    for line in lines:
        record = _record(line)
        if record.get("JobId") == str(job_id):
            return record
    raise SlurmParseError("missing", f"scontrol output has no record for job {job_id}")


@dataclass(frozen=True)
class Controller:
    role: str  # "primary", "backup", "backup1", ...
    host: str
    up: bool


@dataclass(frozen=True)
class Ping:
    """`scontrol ping`: ``up`` when any controller answers."""

    controllers: tuple[Controller, ...]

    @property
    def up(self) -> bool:
        return any(c.up for c in self.controllers)


def parse_ping(text: str, returncode: int) -> Ping:
    """Parse `scontrol ping` (stdout and stderr together) and its exit code.

    Slurm exits 1 when a controller is DOWN; the text decides. Raises
    SlurmParseError("unrecognised") when no controller line is found.
    """
    controllers = tuple(
        Controller(m.group(1), m.group(2), m.group(3) == "UP") for m in PING_LINE.finditer(text)
    )
    if not controllers:
        first = text.strip().splitlines()[0][:200] if text.strip() else "no output"
        raise SlurmParseError("unrecognised", f"scontrol ping (rc {returncode}): {first}")
    return Ping(controllers)


@dataclass(frozen=True)
class QueueJob:
    """One job of `squeue --json`. ``states`` is the base state first, then any flags."""

    job_id: int
    states: tuple[str, ...]
    user: str | None = None
    partition: str | None = None
    nodes: tuple[str, ...] = ()
    gres_detail: tuple[str, ...] = ()
    end_time: int | None = None
    account: str | None = None
    name: str | None = None
    comment: str | None = None
    extra: Mapping[str, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def state(self) -> str:
        return self.states[0]

    def gpus(self) -> tuple[int, ...]:
        """The job's GPU indices from gres_detail (all nodes together)."""
        return tuple(sorted({i for d in self.gres_detail for i in gpu_indices_from_gres(d)}))


def _number(value: object) -> int | None:
    """22.05 prints plain numbers; 23.02+ prints {"set": .., "infinite": .., "number": ..}."""
    if isinstance(value, dict):
        if not value.get("set", False) or value.get("infinite", False):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _states(value: object) -> tuple[str, ...]:
    """22.05: "RUNNING"; 23.02+: ["RUNNING"] or ["RUNNING", "COMPLETING"] (flags follow)."""
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    states = tuple(s.upper() for s in items if isinstance(s, str) and s)
    if not states:
        raise SlurmParseError("invalid", f"squeue --json job_state {str(value)[:60]!r} is unusable")
    return states


def _queue_job(raw: Mapping[str, object]) -> QueueJob:
    gres = raw.get("gres_detail")
    nodes = _text(raw.get("nodes"))
    return QueueJob(
        job_id=_number(raw.get("job_id")) or 0,
        states=_states(raw.get("job_state")),
        user=_text(raw.get("user_name")),
        partition=_text(raw.get("partition")),
        nodes=expand_hostlist(nodes) if nodes else (),
        gres_detail=tuple(g for g in gres if isinstance(g, str)) if isinstance(gres, list) else (),
        end_time=_number(raw.get("end_time")),
        account=_text(raw.get("account")),
        name=_text(raw.get("name")),
        comment=_text(raw.get("comment")),
        extra=MappingProxyType(dict(raw)),
    )


def parse_squeue_json(text: str, job_id: int) -> QueueJob | None:
    """Job ``job_id`` from `squeue --json` output, or None when it is not listed.

    22.05 ignores `-j` with --json, so the filtering happens here. Raises
    SlurmParseError: "slurm_error" when Slurm listed errors (e.g. slurmctld
    unreachable, which squeue reports with exit 0), "unrecognised" for
    anything that is not squeue's JSON, "invalid" for a malformed job entry.
    """
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise SlurmParseError("unrecognised", f"squeue --json output is not JSON: {err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs", []), list):
        raise SlurmParseError("unrecognised", "squeue --json output has no jobs list")
    errors = doc.get("errors") or []
    if errors:
        first = errors[0] if isinstance(errors[0], dict) else {"error": str(errors[0])}
        reason = first.get("description") or first.get("error") or "unknown error"
        raise SlurmParseError("slurm_error", f"squeue --json: {str(reason)[:200]}")
    for raw in doc.get("jobs", []):
        if isinstance(raw, dict) and _number(raw.get("job_id")) == job_id:
            return _queue_job(raw)
    return None
