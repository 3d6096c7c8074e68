"""``slurm-fiber files``: where this install keeps what a site copies into place.

A wheel carries, under ``slurm_fiber/share/`` (setup.py): ``contrib/`` (Slurm
config snippets, the Grafana dashboard, the Prometheus alert rules, the
systemd unit, the SPANK plugin's source when it ships), the man pages
(``man/``, for ``MANPATH``) and the bash and zsh completion (``completion/``).
An editable checkout has no ``share/``: its contrib/ is the checkout's, and
the man pages and completion are built with ``python -m
slurm_fiber.cli.reference build DIR``. The command only prints paths; it
copies nothing.
"""

from __future__ import annotations

from pathlib import Path

import typer

KINDS = ("contrib", "man", "bash", "zsh")
HELP = (
    "Where this install keeps contrib files, man pages and completion: the files a site "
    "copies into place. contrib (Slurm snippets, Grafana dashboard, Prometheus rules, "
    "systemd units), man (for MANPATH), bash and zsh (completion scripts). One KIND "
    "prints its path alone.\n\n"
    "Exit codes: 0 success; 1 not in this install (one line says why); 2 usage error."
)


def locations() -> dict[str, Path]:
    """Each kind's directory in this install (an editable checkout: contrib only)."""
    package = Path(__file__).resolve().parents[1]
    share = package / "share"
    if share.is_dir():
        return {"contrib": share / "contrib", "man": share / "man",
                "bash": share / "completion" / "bash", "zsh": share / "completion" / "zsh"}
    return {"contrib": package.parent / "contrib"}


def files(kind: str = typer.Argument("", metavar="[KIND]",
                                     help="contrib, man, bash or zsh; none: all")) -> None:
    found = locations()
    if kind and kind not in KINDS:
        typer.echo(f"files: no kind {kind!r}; use one of {', '.join(KINDS)}", err=True)
        raise typer.Exit(2)
    if kind:
        if kind not in found:
            typer.echo(f"files: no {kind} in an editable checkout; build them with "
                       "python -m slurm_fiber.cli.reference build DIR", err=True)
            raise typer.Exit(1)
        typer.echo(str(found[kind]))
        return
    for name, path in found.items():
        typer.echo(f"{name}\t{path}")
