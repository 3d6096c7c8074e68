"""``slurm-fiber lease``: one holder at a time for a machine's shared resources.

Commands work for any resource (a GPU, a shared installation, a browser).
The group takes ``--dir``, ``--state`` and ``--ttl`` before the command (or
SLURM_FIBER_LEASE_DIR, _STATE, _TTL); each command prints a table or, with ``--json``, one
JSON document on stdout. Exit codes: 0 done, 1 refused or failed (one line
on stderr; with ``--json`` the refusal is also the JSON document), 2 usage.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import psutil
import typer

from slurm_fiber.core.clock import SystemClock
from slurm_fiber.lease.errors import LeaseError
from slurm_fiber.lease.leases import DEFAULT_TTL, Caller, Leases
from slurm_fiber.lease.rules import Refusal
from slurm_fiber.lease.stale import holder_gone_reason, process_ref
from slurm_fiber.lease.state import Party, state_to_json

DEFAULT_DIR = Path("/var/lib/slurm-fiber/leases")

app = typer.Typer(
    name="lease",
    help=(
        "Hold a machine's shared resources one holder at a time. A lease is a directory "
        "<dir>/<resource>/ with holder.json; while a supervisor is recorded, a session claims "
        "only what the supervisor allotted it (`lease allot`), in that order. Exit codes: "
        "0 done, 1 refused or failed, 2 usage."
    ),
    no_args_is_help=True,
)
supervise_app = typer.Typer(
    help="Record or end the supervisor whose allotments rule claims.", no_args_is_help=True
)
upgrade_app = typer.Typer(
    help="Record upgrades: while one runs on an installation only unblock grants admit claims.",
    no_args_is_help=True,
)
app.add_typer(supervise_app, name="supervise")
app.add_typer(upgrade_app, name="upgrade")

DirOpt = Annotated[
    Path,
    typer.Option("--dir", envvar="SLURM_FIBER_LEASE_DIR", help="The lease directory."),
]
StateOpt = Annotated[
    Path | None,
    typer.Option(
        "--state",
        envvar="SLURM_FIBER_LEASE_STATE",
        help="The state document (supervisor, grants, upgrades). Default: <dir>/state.json.",
    ),
]
TtlOpt = Annotated[
    float,
    typer.Option(
        "--ttl", envvar="SLURM_FIBER_LEASE_TTL",
        help="Seconds an allotment stays claimable once free.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]
SessionOpt = Annotated[
    str,
    typer.Option(
        "--session",
        envvar="SLURM_FIBER_SESSION",
        help="Your session id (what grants name). Empty: you act as a person.",
    ),
]
PidOpt = Annotated[
    int,
    typer.Option(
        "--pid",
        envvar="SLURM_FIBER_PID",
        help="The process that holds what you claim (default: the calling shell). "
        "When it is gone the lease is stale.",
    ),
]
TeamOpt = Annotated[str, typer.Option("--team", envvar="SLURM_FIBER_TEAM", help="Your team.")]
ResArg = Annotated[str, typer.Argument(help="The resource, e.g. gpu0 or kind-lab.")]


@app.callback()
def _options(
    ctx: typer.Context,
    lease_dir: DirOpt = DEFAULT_DIR,
    state: StateOpt = None,
    ttl: TtlOpt = DEFAULT_TTL,
) -> None:
    """Options shared by every lease command (give them before the command)."""
    if not ttl > 0:  # also NaN
        raise typer.BadParameter(f"must be a positive number of seconds, got {ttl:g}",
                                 param_hint="--ttl")
    ctx.obj = Leases(lease_dir, state or lease_dir / "state.json", SystemClock(), ttl=ttl)


def _caller(session: str, team: str, pid: int) -> Caller:
    holder_pid = pid or os.getppid()
    try:
        process = process_ref(holder_pid)
    except psutil.Error:
        raise LeaseError(f"process {holder_pid} does not exist; --pid names the holder") from None
    party = Party(session=session, person=getpass.getuser(), team=team, host=socket.gethostname())
    return Caller(party=party, process=process)


def _emit(as_json: bool, doc: Any, line: str) -> None:
    typer.echo(json.dumps(doc, sort_keys=True) if as_json else line)


def _run(as_json: bool, action: Callable[[], None]) -> None:
    """Run ``action``; turn a Refusal or LeaseError into one line and exit 1."""
    try:
        action()
    except Refusal as err:
        if as_json:
            doc = {"refused": err.reason, "position": err.position, "ahead": err.ahead}
            typer.echo(json.dumps(doc, sort_keys=True))
        place = f" [position {err.position}, ahead: {err.ahead}]" if err.position else ""
        ahead = f" [ahead: {err.ahead}]" if err.ahead and not err.position else ""
        print(f"refused: {err.reason}{place}{ahead}", file=sys.stderr)
        raise typer.Exit(1) from None
    except LeaseError as err:
        if as_json:
            typer.echo(json.dumps({"error": str(err)}))
        print(f"error: {err}", file=sys.stderr)
        raise typer.Exit(1) from None


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


@app.command("ls")
def ls_cmd(
    ctx: typer.Context,
    as_json: JsonOpt = False,
) -> None:
    """List held leases (oldest first), the supervisor and the pending allotments."""

    def act() -> None:
        leases = ctx.obj
        holders, st = leases.dir.list(), leases.state()
        stale = {h.env: holder_gone_reason(h, leases.host) for h in holders}
        if as_json:
            doc = {"leases": [h.to_json() | {"stale": stale[h.env]} for h in holders]}
            _emit(True, doc | state_to_json(st), "")
            return
        rows = [["RESOURCE", "HOLDER", "SINCE", "STALE", "PURPOSE"]]
        rows += [
            [h.label(), h.holder, h.since, "yes" if stale[h.env] else "", h.purpose]
            for h in holders
        ]
        lines = [_table(rows) if holders else "no leases held"]
        sup = st.supervisor
        shown = "none" if sup is None else sup.party.display() + (" (gone)" if sup.gone else "")
        lines.append(f"supervisor: {shown}")
        lines += [f"grant: {g.resource} -> {g.to.display()}" for g in st.grants]
        typer.echo("\n".join(lines))

    _run(as_json, act)


@app.command("claim")
def claim_cmd(
    ctx: typer.Context,
    resource: ResArg,
    purpose: Annotated[str, typer.Option("--purpose", help="What you hold it for (one line).")],
    budget: Annotated[int, typer.Option("--budget", help="GiB your models may hold.")] = 0,
    steal_stale: Annotated[
        bool, typer.Option("--steal-stale", help="Reclaim from a provably gone holder (audited).")
    ] = False,
    session: SessionOpt = "",
    team: TeamOpt = "",
    pid: PidOpt = 0,
    as_json: JsonOpt = False,
) -> None:
    """Claim RESOURCE. Refused (exit 1) when held, not allotted to you, or behind others."""

    def act() -> None:
        leases = ctx.obj
        holder = leases.claim(resource, _caller(session, team, pid), purpose, budget, steal_stale)
        _emit(as_json, holder.to_json(), f"claimed {holder.label()} since {holder.since}")

    _run(as_json, act)


@app.command("release")
def release_cmd(
    ctx: typer.Context,
    resource: ResArg,
    force: Annotated[
        bool, typer.Option("--force", help="Release another's lease (audited).")
    ] = False,
    session: SessionOpt = "",
    team: TeamOpt = "",
    pid: PidOpt = 0,
    as_json: JsonOpt = False,
) -> None:
    """Release RESOURCE (yours, or anyone's with --force). Releasing a free one is a no-op."""

    def act() -> None:
        was = ctx.obj.release(resource, _caller(session, team, pid), force)
        doc = {"released": resource, "holder": was.to_json() if was else None}
        _emit(as_json, doc, f"released {resource}" if was else f"{resource} was free")

    _run(as_json, act)


@app.command("allot")
def allot_cmd(
    ctx: typer.Context,
    resource: ResArg,
    to: Annotated[str, typer.Option("--to", help="The session id the resource is allotted to.")],
    upgrade_unblock: Annotated[
        str, typer.Option("--upgrade-unblock", help="Admit the claim during an upgrade, for WHY.")
    ] = "",
    session: SessionOpt = "",
    team: TeamOpt = "",
    pid: PidOpt = 0,
    as_json: JsonOpt = False,
) -> None:
    """As the supervisor, allot RESOURCE to the session --to; allotments queue in order given."""

    def act() -> None:
        leases = ctx.obj
        place = leases.grant(
            resource, Party(session=to), _caller(session, team, pid), upgrade_unblock
        )
        doc = {"resource": resource, "to": to, "position": place}
        _emit(as_json, doc, f"allotted {resource} to {to} (number {place} in its queue)")

    _run(as_json, act)


# The old name, kept so scripts keep working: "grant" is the signed token everywhere else.
# click prints the deprecation on stderr when it runs; --help no longer lists it. The state
# document keeps calling allotments ``grants`` (docs/lease-format.md).
app.command("grant", hidden=True, deprecated=True)(allot_cmd)


@app.command("prune")
def prune_cmd(
    ctx: typer.Context,
    as_json: JsonOpt = False,
) -> None:
    """Drop allotments whose time ran out (those of held resources wait)."""

    def act() -> None:
        dropped = ctx.obj.prune()
        doc = {"dropped": [{"resource": g.resource, "to": g.to.to_json()} for g in dropped]}
        _emit(as_json, doc, f"dropped {len(dropped)} allotment(s)")

    _run(as_json, act)


@supervise_app.command("start")
def supervise_start_cmd(
    ctx: typer.Context,
    session: SessionOpt = "",
    team: TeamOpt = "",
    pid: PidOpt = 0,
    as_json: JsonOpt = False,
) -> None:
    """Become the supervisor: from now until a deliberate stop, claims need your grants."""

    def act() -> None:
        sup = ctx.obj.supervise_start(_caller(session, team, pid))
        doc = {"supervisor": sup.party.to_json(), "pid": sup.pid}
        _emit(as_json, doc, f"supervising as {sup.party.display()}")

    _run(as_json, act)


@supervise_app.command("stop")
def supervise_stop_cmd(
    ctx: typer.Context,
    force: Annotated[
        bool, typer.Option("--force", help="Stop another's supervision (audited).")
    ] = False,
    session: SessionOpt = "",
    team: TeamOpt = "",
    pid: PidOpt = 0,
    as_json: JsonOpt = False,
) -> None:
    """Deliberately stop supervising: a free lease is permission again."""

    def act() -> None:
        old = ctx.obj.supervise_stop(_caller(session, team, pid), force)
        doc = {"stopped": old.party.to_json() if old else None}
        _emit(as_json, doc, f"stopped supervisor {old.party.display()}" if old else "no supervisor")

    _run(as_json, act)


@upgrade_app.command("start")
def upgrade_start_cmd(
    ctx: typer.Context,
    installation: Annotated[str, typer.Argument(help="The installation (a resource's name).")],
    reason: Annotated[str, typer.Option("--reason", help="What the upgrade is.")],
    session: SessionOpt = "",
    team: TeamOpt = "",
    pid: PidOpt = 0,
    as_json: JsonOpt = False,
) -> None:
    """Record an upgrade running on INSTALLATION until `upgrade end`."""

    def act() -> None:
        ctx.obj.upgrade_start(installation, reason, _caller(session, team, pid))
        _emit(as_json, {"upgrade": installation}, f"upgrade of {installation} recorded")

    _run(as_json, act)


@upgrade_app.command("end")
def upgrade_end_cmd(
    ctx: typer.Context,
    installation: Annotated[str, typer.Argument(help="The installation.")],
    as_json: JsonOpt = False,
) -> None:
    """End the upgrade recorded on INSTALLATION."""

    def act() -> None:
        ended = ctx.obj.upgrade_end(installation)
        _emit(as_json, {"ended": ended}, "upgrade ended" if ended else "no upgrade was recorded")

    _run(as_json, act)
