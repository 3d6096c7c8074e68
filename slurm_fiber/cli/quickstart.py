"""``slurm-fiber quickstart``: the main job, end to end on this machine, with no set-up.

In a fresh temporary directory it makes a throwaway issuer and one grant
whose template preloads real, slow-to-import modules, starts the real
``fiberd`` (standalone home, its own socket) from this environment, shows
progress while the template warms, times a cold interpreter start with the
same imports, runs Clones through the socket in call mode and exec mode,
prints a short table (cold start vs Clone p50/p99, the ratio, the cgroup
mode with the limits this host does not enforce and how devices are
confined, where the audit log is), and stops fiberd cleanly: it then walks /proc
and fails if any template or fiber of this run is still alive. Afterwards
only the audit log is kept (everything with ``--keep``; everything on a
failure, so fiberd's log can be read). Works as root or as a plain user (a
plain user usually gets the uncarved mode: no cgroup to delegate).

Exit codes: 0 success; 1 something failed (one line on stderr says what and
where its log is); 2 usage error. Progress goes to stderr; the table (or,
with ``--json``, one JSON object of figures) to stdout.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import typer

from slurm_fiber.cli.latency import (
    CALL_TARGET,
    EXEC_ARGV,
    MODES,
    MeasureFailed,
    clone_round_trips,
    cold_start,
    import_line,
    percentiles,
    ratio,
)
from slurm_fiber.cli.throwaway import GRANT, Site, SiteFailed

# Standard-library modules whose cold import takes well over 200 ms together here.
DEFAULT_PRELOADS = (
    "json", "decimal", "asyncio", "email", "http.client", "email.mime.multipart",
    "urllib.request", "xml.etree.ElementTree", "logging.handlers", "argparse", "sqlite3",
    "unittest",
)

HELP = (
    'Run the main job here, with nothing set up: a throwaway issuer and grant, a real fiberd '
    '(standalone home) whose warm template preloads slow-to-import modules, then Clones '
    'through its socket timed against a cold `python -c "import ..."`.\n\n'
    'Prints progress on stderr while the template warms, then a table: cold start vs Clone '
    'p50/p99 (call mode and exec mode), the ratio, the cgroup mode (with the limits this host '
    'does not enforce and how devices are confined) and where the audit log is '
    '(read it with `slurm-fiber audit --path FILE`). fiberd is stopped at the end and nothing '
    'of the run is left running. Only the audit log is kept, unless --keep.\n\n'
    'Exit codes: 0 success; 1 failed (one line says why); 2 usage error.'
)


def say(line: str) -> None:
    """One progress line on stderr."""
    typer.echo(f"quickstart: {line}", err=True)


class WarmProgress:
    """Prints the template's state when it changes and once a second while it warms."""

    def __init__(self) -> None:
        self.last: tuple[str, int] | None = None

    def __call__(self, state: str, seconds: float) -> None:
        mark = (state, int(seconds))
        if mark != self.last:
            self.last = mark
            say(f"template {GRANT!r}: {state} ({seconds:.1f} s)")


def measure(site: Site, cold_runs: int, clones: int) -> dict[str, Any]:
    """Cold starts and Clones on the warm site; the figures. Raises MeasureFailed."""
    say(f"timing a cold start, {cold_runs} runs of python -c {import_line(site.preloads)!r}")
    cold = percentiles(cold_start(site.preloads, cold_runs))
    figures: dict[str, Any] = {"cold_start": {**cold, "runs": cold_runs}}
    for mode in MODES:
        say(f"running {clones} {mode}-mode clones through {site.socket}")
        clone = percentiles(clone_round_trips(site.socket, mode, clones, grant=GRANT))
        figures[f"clone_{mode}"] = {**clone, "runs": clones,
                                    "speedup_p50": ratio(cold["p50_ms"], clone["p50_ms"])}
    return figures


def table(figures: dict[str, Any]) -> str:
    """The human summary of a successful run (``figures`` as ``run`` returns them)."""
    rows = [("cold start: python -c \"import <preloads>\"", figures["cold_start"], "")]
    for mode, what in (("call", CALL_TARGET), ("exec", " ".join(EXEC_ARGV))):
        clone = figures[f"clone_{mode}"]
        rows.append((f"Clone, {mode} mode ({what})", clone,
                     f"{clone['speedup_p50']:.0f}x faster"))
    lines = [f"{'':46}{'p50':>10}{'p99':>11}"]
    lines += [f"{name:46}{f['p50_ms']:>7.1f} ms{f['p99_ms']:>8.1f} ms  {note}".rstrip()
              for name, f, note in rows]
    lines += [
        "",
        f"preloads ({len(figures['preloads'])}): {', '.join(figures['preloads'])}",
        f"template warmed in {figures['warm_seconds']:.2f} s; "
        f"{figures['clones_per_mode']} clones per mode through fiberd's socket",
        f"cgroups: {figures['mode']}{backend_brief(figures['cgroups'])} "
        f"({figures['cgroups']['reason']}); "
        f"{enforcement_brief(figures.get('enforcement'))}",
        f"audit log: {figures['audit_path']}",
        f"  read it: slurm-fiber audit --path {figures['audit_path']}",
        "fiberd stopped cleanly; nothing of this run is left running",
    ]
    return "\n".join(lines)


def backend_brief(cgroups: dict[str, object]) -> str:
    """Carved: " by <backend>: where stop, emptiness, limits and devices live"."""
    enforced = cgroups.get("enforced")
    return f" by {enforced}" if cgroups.get("carved") and enforced else ""


def enforcement_brief(host: object) -> str:
    """What this host enforces, briefly: the limits a grant could ask for that nothing
    enforces here, and how devices are confined (``status``'s enforcement host record)."""
    if not isinstance(host, dict):
        return "limits enforced: unknown"
    missing = host.get("unenforced") or []
    devices = host.get("devices")
    confined = devices.get("confined_by") if isinstance(devices, dict) else "unknown"
    limits = (f"limits NOT enforced here: {', '.join(map(str, missing))}" if missing
              else "every limit enforced")
    return f"{limits}; devices: {confined}"


def finish(site: Site, keep: bool) -> list[int]:
    """Stop fiberd; remove what is not kept. Returns pids left running (none on success)."""
    say("stopping fiberd")
    status = site.stop()
    left = site.leftovers()
    if status not in (0, None):
        raise SiteFailed(f"fiberd exited with status {status} on SIGTERM: "
                         f"{site.last_log_line()}")
    if not keep and not left:
        for entry in site.root.iterdir():
            if entry != site.audit_path:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return left


def _host_enforcement(status: dict[str, object]) -> object:
    enforcement = status.get("enforcement")
    return enforcement.get("host") if isinstance(enforcement, dict) else None


def run(preloads: tuple[str, ...], clones: int, cold_runs: int, cgroup_root: str,
        warm_timeout: float, keep: bool) -> dict[str, Any]:
    """The whole quickstart; its figures. Raises SiteFailed or MeasureFailed (site kept)."""
    root = Path(tempfile.mkdtemp(prefix="slurm-fiber-quickstart-"))
    say(f"a throwaway issuer and grant in {root}")
    site = Site.create(root, preloads)
    try:
        say(f"starting fiberd (standalone home, socket {site.socket})")
        site.start(cgroup_root)
        warm = site.wait_warm(warm_timeout, WarmProgress())
        say(f"template {GRANT!r} is warm after {warm:.2f} s")
        status = site.request("status")
        figures = measure(site, cold_runs, clones)
    except (SiteFailed, MeasureFailed, OSError, KeyboardInterrupt) as err:
        site.stop()
        why = "interrupted" if isinstance(err, KeyboardInterrupt) else str(err)
        raise SiteFailed(f"{why} (kept {root}; fiberd's log {site.log_path})") from None
    left = finish(site, keep)
    if left:
        raise SiteFailed(f"still running after fiberd stopped: pids {left} (kept {root})")
    return {"run_id": site.run_id, "preloads": list(preloads), **figures,
            "clones_per_mode": clones, "warm_seconds": round(warm, 3), "mode": status.get("mode"),
            "cgroups": status.get("cgroups"), "audit_path": str(site.audit_path),
            "enforcement": _host_enforcement(status),
            "kept": str(root), "kept_everything": keep, "left_running": left}


def quickstart(
    clones: int = typer.Option(200, "--clones", "-n", min=1, max=100_000,
                               help="Clones per mode (call and exec)."),
    cold_runs: int = typer.Option(10, "--cold-runs", min=1, max=1000,
                                  help="Cold interpreter starts to time."),
    preload: list[str] = typer.Option(
        list(DEFAULT_PRELOADS), "--preload", metavar="MODULE",
        help="Module the template preloads (repeatable; replaces the default list, which "
             "imports in well over 200 ms cold). Must include json (the call-mode target)."),
    cgroup_root: str = typer.Option("delegate", "--cgroup-root", metavar="delegate|none|PATH",
                                    help="fiberd's cgroup root (delegate: a subtree of its "
                                         "own cgroup when it may; else it runs uncarved)."),
    warm_timeout: float = typer.Option(60.0, "--warm-timeout", min=1.0,
                                       help="Seconds to wait for the template to warm."),
    keep: bool = typer.Option(False, "--keep", help="Keep the whole temporary directory "
                                                    "(key, grant, state, fiberd's log)."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as one JSON object."),
) -> None:
    if "json" not in preload:
        typer.echo("quickstart: --preload must include json (the call-mode target "
                   f"{CALL_TARGET} runs in the warm interpreter)", err=True)
        raise typer.Exit(2)
    try:
        figures = run(tuple(preload), clones, cold_runs, cgroup_root, warm_timeout, keep)
    except (SiteFailed, MeasureFailed, OSError) as err:
        typer.echo(f"quickstart: failed: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(figures) if as_json else table(figures))
