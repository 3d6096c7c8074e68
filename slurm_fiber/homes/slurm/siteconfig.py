"""The site's slurm_fiber configuration on a Slurm node: one TOML file, read by every part.

The prolog mints and imports grant tokens with it, the epilog bounds its
work with it, and fiberd-run (``--home slurm``) verifies tokens with its
trust table and finds the job's state under its state root. The file is
``$SLURM_FIBER_CONFIG``, default /etc/slurm-fiber/slurm-fiber.toml; a
missing default file is an empty configuration (every key has a default),
a missing file named by the variable is a refusal. Example::

    issuer = "citest"                         # iss of the tokens the prolog mints
    issuer_key = "/etc/slurm-fiber/citest.key"   # no key: the prolog mints nothing
    state_root = "/var/lib/slurm-fiber"       # SLURM_FIBER_STATE_ROOT still wins
    spool_dir = "/var/spool/slurm-fiber"      # <spool>/<cluster>/<job id>/*.jwt
    gres_conf = "/etc/slurm/gres.conf"        # GPU device files (optional)
    delegate_cgroup = false                   # site opt-in: a cgroup subtree per job
    # cgroup_parent = "/sys/fs/cgroup/sf"     # where job subtrees go (default: see below)
    publish_comment = false                   # readiness also in the job's Comment
    fatal = []                                # prolog checks that drain the node
    step_seconds = 2.0                        # time bound of each hook step
    lease_ttl = 604800                        # how long a GPU grant stays claimable
    token_lifetime = 86400                    # minted token's life when the job's end is unknown

    [trust]                                   # issuer -> JWKS file
    citest = "/etc/slurm-fiber/citest.jwks.json"

    [grant]                                   # the minted token's `fiber` claim, as JSON has it
    devices = ["gpu"]
    template = { preload = ["json"] }
    limits = { fibers = 8, seconds = 600 }

The prolog checks named in ``fatal`` are ``config``, ``job``, ``state_dir``,
``tokens``, ``spool``, ``leases`` and ``cgroup`` (``CHECKS``). The default
``cgroup_parent`` is ``<cgroup2 mount>/slurm-fiber`` (hooks/cgroup). Relative paths
are taken from the file's directory. Every refusal is one ``SiteConfigError``
line naming the key; unknown keys are refused so a typo is never a silent
default. Pure apart from reading the one file.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from slurm_fiber.core.fibers.spec import BadFiberClaim, parse_fiber_spec
from slurm_fiber.core.trust.grant import FiberSpec
from slurm_fiber.defaults import DEFAULT_SITE_CONFIG, SITE_CONFIG_ENV, STATE_ROOT_ENV
from slurm_fiber.homes.slurm.gres import gpu_files
from slurm_fiber.homes.slurm.home import SlurmHomeConfig
from slurm_fiber.homes.slurm.jobenv import SlurmParseError
from slurm_fiber.homes.slurm.paths import DEFAULT_STATE_ROOT

CONFIG_ENV = SITE_CONFIG_ENV
DEFAULT_CONFIG = Path(DEFAULT_SITE_CONFIG)
MAX_CONFIG_BYTES = 1 << 20
CHECKS = ("config", "job", "state_dir", "tokens", "spool", "leases", "cgroup")
ISSUER_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:/@-")


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
        with path.open("rb") as fh:
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
        return tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise SiteConfigError(f"{path}: not valid TOML ({err})") from None


@dataclass(frozen=True)
class SiteConfig:
    """The site's settings; see the module docstring for each key. Every field has a default.

    ``fatal`` is a frozenset of CHECKS names; ``grant`` the FiberSpec every
    minted token carries; ``source`` the file read (None: defaults only).
    """

    issuer: str = ""
    issuer_key: Path | None = None
    trust: Mapping[str, Path] = field(default_factory=lambda: MappingProxyType({}))
    state_root: Path = DEFAULT_STATE_ROOT
    spool_dir: Path | None = None
    gres_conf: Path | None = None
    delegate_cgroup: bool = False
    cgroup_parent: Path | None = None
    publish_comment: bool = False
    fatal: frozenset[str] = frozenset()
    step_seconds: float = 2.0
    lease_ttl: float = 7 * 86400.0
    token_lifetime: float = 86400.0
    grant: FiberSpec = field(default_factory=FiberSpec)
    source: Path | None = None

    def is_fatal(self, check: str) -> bool:
        """Whether a failure of prolog check ``check`` must drain the node."""
        return check in self.fatal


def _path(value: object, key: str, base: Path) -> Path:
    if not isinstance(value, str) or not value or "\0" in value:
        raise ValueError("must be a non-empty path string")
    return base / value if not os.path.isabs(value) else Path(value)


def _issuer(value: object, key: str, base: Path) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 256 or not set(value) <= ISSUER_CHARS:
        raise ValueError("must be a name of letters, digits and ._:/@- (up to 256)")
    return value


def _bool(value: object, key: str, base: Path) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _seconds(low: float, high: float) -> Callable[[object, str, Path], float]:
    def parse(value: object, key: str, base: Path) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("must be a number of seconds")
        if not math.isfinite(value) or not low <= value <= high:
            raise ValueError(f"must be between {low:g} and {high:g} seconds")
        return float(value)

    return parse


def _fatal(value: object, key: str, base: Path) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("must be a list of check names")
    unknown = sorted(set(value) - set(CHECKS))
    if unknown:
        raise ValueError(f"names unknown checks {unknown}; known: {', '.join(CHECKS)}")
    return frozenset(value)


def _trust(value: object, key: str, base: Path) -> Mapping[str, Path]:
    if not isinstance(value, dict):
        raise ValueError("must be a table of issuer = JWKS path")
    return MappingProxyType({_issuer(k, key, base): _path(v, f"{key}.{k}", base)
                             for k, v in value.items()})


def _grant(value: object, key: str, base: Path) -> FiberSpec:
    try:
        return parse_fiber_spec(value)
    except BadFiberClaim as err:
        raise ValueError(str(err)) from None


_PARSERS = {
    "issuer": _issuer, "issuer_key": _path, "trust": _trust, "state_root": _path,
    "spool_dir": _path, "gres_conf": _path, "delegate_cgroup": _bool, "cgroup_parent": _path,
    "publish_comment": _bool, "fatal": _fatal, "step_seconds": _seconds(0.05, 60.0),
    "lease_ttl": _seconds(60.0, 366 * 86400.0), "token_lifetime": _seconds(60.0, 366 * 86400.0),
    "grant": _grant,
}


def _build(doc: dict[str, Any], source: Path) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, raw in doc.items():
        parse = _PARSERS.get(key)
        if parse is None:
            raise SiteConfigError(f"{source}: unknown key {key!r}; known: {', '.join(_PARSERS)}")
        try:
            values[key] = parse(raw, key, source.parent)
        except ValueError as err:
            raise SiteConfigError(f"{source}: {key}: {err}") from None
    return values


def fatal_checks(environ: Mapping[str, str]) -> frozenset[str]:
    """The ``fatal`` list of the config file alone, even when other keys are broken.

    Used by the prolog to decide whether a broken configuration drains the
    node. Never raises: an unreadable file or list gives the empty set.
    """
    path, explicit = config_path(environ)
    try:
        doc = read_site_file(path, explicit) or {}
        return _fatal(doc.get("fatal", []), "fatal", path.parent)
    except (SiteConfigError, ValueError):
        return frozenset()


def load_site_config(environ: Mapping[str, str]) -> SiteConfig:
    """The site configuration for ``environ`` (pass os.environ, or a hook's environment).

    Blocks on reading one small file. ``SLURM_FIBER_STATE_ROOT`` in
    ``environ`` overrides ``state_root``. Raises SiteConfigError (one line)
    for an unreadable file, bad TOML, an unknown key or a bad value, and
    when ``issuer_key`` is set without ``issuer``.
    """
    path, explicit = config_path(environ)
    doc = read_site_file(path, explicit)
    values = {} if doc is None else _build(doc, path)
    if values.get("issuer_key") and not values.get("issuer"):
        raise SiteConfigError(f"{path}: issuer_key is set but issuer is not: name the issuer")
    override = environ.get(STATE_ROOT_ENV, "")
    if override:
        if not os.path.isabs(override):
            raise SiteConfigError(f"{STATE_ROOT_ENV}={override[:200]!r} must be an absolute path")
        values["state_root"] = Path(override)
    return SiteConfig(**values, source=None if doc is None else path)


def home_config(config: SiteConfig, node: str, **settings: Any) -> SlurmHomeConfig:
    """The Slurm home's settings for ``node`` under this site (fiberd-run's call).

    State root and ``publish_comment`` come from the site, GPU device files
    from its ``gres_conf`` (none when unset); ``settings`` set the home's
    other fields (poll intervals). Blocks on reading gres.conf; raises
    SiteConfigError when it cannot be read or parsed.
    """

    files: dict[int, str] = {}
    if config.gres_conf is not None:
        try:
            files = gpu_files(config.gres_conf.read_text(errors="replace"), node)
        except OSError as err:
            raise SiteConfigError(f"gres_conf {config.gres_conf}: {err.strerror}") from None
        except SlurmParseError as err:
            raise SiteConfigError(f"gres_conf {config.gres_conf}: {err.reason}") from None
    return SlurmHomeConfig(state_root=config.state_root, publish_comment=config.publish_comment,
                           gpu_files=files, **settings)
