"""The Slurm site file's ``state_root``, as a client inside a job reads it to find the job's socket.

The rules are fiberd-run's (homes.slurm.siteconfig): ``$SLURM_FIBER_STATE_ROOT``
wins (absolute, or ValueError); else the site file's top-level ``state_root``,
relative to the file's directory; else the default root. The site file is
``$SLURM_FIBER_CONFIG`` (absolute), default /etc/slurm-fiber/slurm-fiber.toml. A
file that cannot be read, is not TOML, or whose ``state_root`` is not a path
counts as unset: fiberd-run refuses such a file, so no fiberd listens at either
path and the client's wait ends in its usual refusal.

Read here, not through siteconfig, because the client package is a declared
speed place (slurm_fiber/client/__init__.py): a small reader takes the key from
its line when the file says it plainly (``plain_state_root``) and parses the
file with tomllib only otherwise, so the common site file costs ``fiberctl``
neither tomllib, ``re`` nor the grant code siteconfig validates with. In a valid
TOML file the plain line's value is the one tomllib reads
(tests/client/test_siteroot.py checks both readers agree).
"""

from __future__ import annotations

import os

from slurm_fiber.defaults import DEFAULT_SITE_CONFIG, SITE_CONFIG_ENV, STATE_ROOT_ENV, state_root_of

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the client's budget)
if TYPE_CHECKING:
    from collections.abc import Mapping

MAX_SITE_FILE = 1 << 20  # siteconfig refuses a larger file
_BLANK = " \t"  # TOML's whitespace


def site_text(path: str) -> str | None:
    """The text of the site file at ``path``; None when it cannot be read as a site file
    (relative path, absent, unreadable, too large, not UTF-8). Blocks on one small read."""
    if not os.path.isabs(path):
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_SITE_FILE + 1)
    except OSError:
        return None
    if len(raw) > MAX_SITE_FILE:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def parsed_state_root(text: str) -> object:
    """The top-level ``state_root`` of ``text`` as tomllib reads it; None when ``text`` is
    not TOML or has no such key."""
    import tomllib  # here: only a site file not said plainly pays for it

    try:
        return tomllib.loads(text).get("state_root")
    except tomllib.TOMLDecodeError:
        return None


def plain_state_root(text: str) -> str | None:
    """The top-level ``state_root`` of site file ``text`` when a line says it plainly
    (``plain_line``) before anything that could change what such a line means: a
    table header (the key would be that table's) or a multi-line string's quotes (the
    line could be inside one); None otherwise, and the caller parses the file. In a valid
    TOML file, a value found is the one tomllib reads; where the rest of the file is not
    valid TOML, it is the line's value, not an error (fiberd-run refuses that file, so no
    fiberd listens at either path). Pure."""
    for line in text.split("\n"):
        line = line.removesuffix("\r").strip(_BLANK)
        if line.startswith("[") or '"""' in line or "'''" in line:
            return None
        found = plain_line(line)
        if found is not None:
            return found
    return None


def plain_line(line: str) -> str | None:
    """The value when ``line`` (stripped) sets the top-level ``state_root`` as sites write
    it: the bare key, ``=``, a basic string with no escape and no control character, at
    most a comment after; else None. Read by hand, not with ``re`` (the client's
    budget). Pure."""
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
    """The state root as fiberd-run takes it (see the module docstring for the rules).
    Blocks on reading the site file; raises ValueError for a relative
    ``$SLURM_FIBER_STATE_ROOT``."""
    override = environ.get(STATE_ROOT_ENV, "")
    if override:
        return state_root_of(override)
    path = environ.get(SITE_CONFIG_ENV, "") or DEFAULT_SITE_CONFIG
    text = site_text(path)
    value = None if text is None else plain_state_root(text) or parsed_state_root(text)
    if isinstance(value, str) and value and "\0" not in value:
        return os.path.join(os.path.dirname(path), value)
    return state_root_of("")
