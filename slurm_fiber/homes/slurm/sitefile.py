"""The site config file itself: where it is, reading it, and the state root it names.

Split from ``siteconfig`` so a client that only needs to find a job's
socket (``fiberctl`` inside a job, on every task it starts) reads one key
with tomllib and nothing else: building the whole ``SiteConfig`` imports
the grant and fiber-spec code, tens of milliseconds per command. Both
read the same file the same way; ``siteconfig`` validates every key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurm_fiber.homes.slurm.paths import STATE_ROOT_ENV, state_root

CONFIG_ENV = "SLURM_FIBER_CONFIG"
DEFAULT_CONFIG = Path("/etc/slurm-fiber/slurm-fiber.toml")
MAX_CONFIG_BYTES = 1 << 20


class SiteConfigError(ValueError):
    """The site configuration cannot be used; ``str()`` is one line naming the file and key."""


def config_path(environ: Mapping[str, str]) -> tuple[Path, bool]:
    """The config file and whether it was named explicitly (``SLURM_FIBER_CONFIG``)."""
    named = environ.get(CONFIG_ENV, "")
    return (Path(named), True) if named else (DEFAULT_CONFIG, False)


def read_site_file(path: Path, explicit: bool) -> dict[str, Any] | None:
    """The decoded TOML at ``path``; None for an absent default file. Blocks on one small
    read. Raises SiteConfigError."""
    if not path.is_absolute():
        raise SiteConfigError(f"{CONFIG_ENV}={str(path)[:200]!r} must be an absolute path")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        if explicit:
            raise SiteConfigError(f"{path}: no such file (named by {CONFIG_ENV})") from None
        return None
    except OSError as err:
        raise SiteConfigError(f"{path}: {err.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise SiteConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    import tomllib  # here: a node without a site file never pays for it (about 3 ms)

    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise SiteConfigError(f"{path}: not valid TOML ({err})") from None


def site_state_root(environ: Mapping[str, str]) -> Path:
    """The state root as fiberd-run takes it: ``SLURM_FIBER_STATE_ROOT``, else the site
    file's ``state_root`` (relative to the file's directory), else the default. A site file
    that cannot be read, or whose ``state_root`` is not a path, counts as unset (fiberd-run
    would refuse it). Raises ValueError for a relative ``SLURM_FIBER_STATE_ROOT``."""
    if environ.get(STATE_ROOT_ENV):
        return state_root(environ)
    path, explicit = config_path(environ)
    try:
        doc = read_site_file(path, explicit)
    except SiteConfigError:
        doc = None
    value = (doc or {}).get("state_root")
    if isinstance(value, str) and value and "\0" not in value:
        return path.parent / value
    return state_root(environ)
