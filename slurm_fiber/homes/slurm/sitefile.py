"""The site config file itself: where it is, reading it, and the state root it names.

``fiberctl`` inside a job finds the job's socket through the state root, and its
import budget (tests/cli/test_fiberctl.py) leaves out tomllib, typing and pathlib
and the grant code ``siteconfig`` needs: this module reads that one key, from its
line when the file says it plainly (``plain_state_root``), else with tomllib.
Both modules read the same file the same way; ``siteconfig`` validates every key.
"""

from __future__ import annotations

import os

from slurm_fiber.homes.slurm.layout import STATE_ROOT_ENV, state_root_of

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (fiberctl imports this)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

CONFIG_ENV = "SLURM_FIBER_CONFIG"
DEFAULT_CONFIG = "/etc/slurm-fiber/slurm-fiber.toml"
MAX_CONFIG_BYTES = 1 << 20
_BLANK = " \t"  # TOML's whitespace


class SiteConfigError(ValueError):
    """The site configuration cannot be used; ``str()`` is one line naming the file and key."""


def config_path(environ: Mapping[str, str]) -> tuple[str, bool]:
    """The config file and whether it was named explicitly (``SLURM_FIBER_CONFIG``)."""
    named = environ.get(CONFIG_ENV, "")
    return (named, True) if named else (DEFAULT_CONFIG, False)


def read_site_file(path: str | os.PathLike[str], explicit: bool) -> dict[str, Any] | None:
    """The decoded TOML at ``path``; None for an absent default file. Blocks on one small
    read. Raises SiteConfigError."""
    text = read_site_text(path, explicit)
    return None if text is None else parse_site_text(path, text)


def read_site_text(path: str | os.PathLike[str], explicit: bool) -> str | None:
    """The text of the file at ``path``; None for an absent default file. Blocks on one
    small read. Raises SiteConfigError."""
    if not os.path.isabs(path):
        raise SiteConfigError(f"{CONFIG_ENV}={os.fspath(path)[:200]!r} must be an absolute path")
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
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SiteConfigError(f"{path}: not valid TOML ({err})") from None


def parse_site_text(path: str | os.PathLike[str], text: str) -> dict[str, Any]:
    """``text``, the file at ``path``, decoded as TOML. Raises SiteConfigError."""
    import tomllib  # here: only a file to parse pays for it (see the module docstring)

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SiteConfigError(f"{path}: not valid TOML ({err})") from None


def plain_state_root(text: str) -> str | None:
    """The top-level ``state_root`` of site file ``text`` when a line says it plainly
    (``plain_line``) before anything that could change what such a line means: a
    table header (the key would be that table's) or a multi-line string's quotes (the
    line could be inside one); None otherwise, and the caller parses the file. In a valid
    TOML file, a value found is the one tomllib reads; where the rest of the file is not
    valid TOML, it is the line's value, not an error (fiberd-run refuses that file, so no
    fiberd listens at either path). Pure."""
    for line in text.split("\n"):
        line = line.removesuffix("\r").strip(" \t")
        if line.startswith("[") or '"""' in line or "'''" in line:
            return None
        found = plain_line(line)
        if found is not None:
            return found
    return None


def plain_line(line: str) -> str | None:
    """The value when ``line`` (stripped) sets the top-level ``state_root`` as sites write
    it: the bare key, ``=``, a basic string with no escape and no control character, at
    most a comment after; else None. Read by hand, not with ``re``: this runs in each
    ``fiberctl`` started in a job (homes.slurm.names says why). Pure."""
    rest = line.removeprefix("state_root")
    if rest == line:
        return None
    rest = rest.lstrip(_BLANK)
    if not rest.startswith("="):
        return None
    rest = rest[1:].lstrip(_BLANK)
    if not rest.startswith('"'):
        return None
    end = rest.find('"', 1)
    if end < 0:
        return None
    value, tail = rest[1:end], rest[end + 1:].lstrip(_BLANK)
    if any(c == "\\" or c < " " or c == "\x7f" for c in value):
        return None
    if tail and (tail[0] != "#" or any((c < " " and c != "\t") or c == "\x7f"
                                       for c in tail[1:])):
        return None
    return value


def site_state_root(environ: Mapping[str, str]) -> str:
    """The state root as fiberd-run takes it: ``SLURM_FIBER_STATE_ROOT``, else the site
    file's ``state_root`` (relative to the file's directory), else the default. A site file
    that cannot be read, or whose ``state_root`` is not a path, counts as unset (fiberd-run
    would refuse it). Raises ValueError for a relative ``SLURM_FIBER_STATE_ROOT``."""
    if environ.get(STATE_ROOT_ENV):
        return state_root_of(environ)
    path, explicit = config_path(environ)
    value: object = None
    try:
        text = read_site_text(path, explicit)
        if text is not None:
            value = plain_state_root(text) or parse_site_text(path, text).get("state_root")
    except SiteConfigError:
        pass
    if isinstance(value, str) and value and "\0" not in value:
        return os.path.join(os.path.dirname(path), value)
    return state_root_of(environ)
