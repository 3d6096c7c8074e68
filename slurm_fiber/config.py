"""fiberd's configuration: every option, where it came from, and why a value is refused.

Sources, lowest to highest precedence: built-in defaults < a TOML file
(``--config FILE``, or ``FIBERD_CONFIG``) < environment variables
``FIBERD_<OPTION>`` < command-line flags ``--<option>`` (the loader takes
the flag values as a dict; None means "not given"). Every value is
validated; a refusal is one ``ConfigError`` line naming the option and its
source (``file.toml:key``, the environment variable, or the flag). Unknown
TOML keys and unknown ``FIBERD_*`` variables are refused, with the nearest
option suggested, so a typo never silently falls back to a default.
Relative paths are taken from the TOML file's directory (file values) or
the working directory (environment and flags).

| option | default | meaning |
|---|---|---|
| home | standalone | a home's name: standalone, slurm, kubernetes or an installed one |
| state_dir | /var/lib/slurm-fiber | fiberd's state; the default of the paths below |
| socket | STATE_DIR/fiberd.sock | the local API's Unix socket |
| audit_path | STATE_DIR/audit.jsonl | the audit log (one JSON line per decision) |
| audit_fsync | always | always (fsync decisions before answering, exits within 0.1 s) or never |
| trust | (none) | issuer → JWKS file; TOML table, env/flag ``iss=path,iss2=path`` |
| audience | (the home's) | the ``aud`` tokens must contain; unset: the home names it |
| leeway | 30 | seconds of clock skew allowed on nbf/iat (0..300) |
| stale_ttl | 60 | seconds of control-plane silence after which the source is stale |
| fence_ttl | 120 | seconds after the last sync a fence ends (>= stale_ttl) |
| grantdir | STATE_DIR/grants | the directory polled for ``*.jwt`` grant files |
| poll_interval | 1 | seconds between grantdir polls |
| cgroup_root | delegate | delegate (a subtree of fiberd's own cgroup), a cgroup v2 path, or none |
| cgroup_backend | auto | auto, v2, v1 or hybrid: where limits, devices, stop live (design §4) |
| devices | (none) | static devices ``kind:index[:path[:uuid]]``, e.g. ``gpu:0:/dev/nvidia0`` |
| ready_file | STATE_DIR/ready.json | readiness JSON, replaced atomically; none: no file |
| allowed_uids | (owner only) | users (uids or names) besides fiberd's own that may use the socket |
| allowed_gids | (none) | groups (gids or names) whose members may use the socket |
| grace | 5 | seconds between SIGTERM and SIGKILL when stopping fibers |
| spares | 2 | fiber processes a template forks ahead once its grant is cloned (0..16; 0: none) |
| spares_idle | 300 | seconds with no Clone before a grant's spares go (0: never) |
| history | 1000 | ended fibers whose last records stay visible (inspect, ``ls --all``; 0: none) |
| history_seconds | 3600 | how long an ended fiber's record stays visible |
| strict_limits | false | refuse (``unenforceable``) a grant asking for limits not enforced here |
| fiber_user | (none) | a root fiberd must name the user fibers run as (``root``: keep root) |
| template_timeout | 10 | seconds a template may take to answer before it is killed and re-warmed |
| task_window | fiberd | template: task windows run windowed exec and call batches (design §4) |
| log_format | text | text or json (one JSON object per line) |
| log_level | info | debug, info, warning or error |
| metrics_listen | (none) | serve HTTP ``/metrics`` on ``HOST:PORT`` (``PORT`` alone: 127.0.0.1) |
| metrics_textfile | (none) | a directory for node_exporter's textfile collector |

A home's own options (kubernetes: ``ready_condition``) are declared in the
home's module, as ``Option``s with their default (``HomeEntry.own_options``);
``homes.select.load_config`` passes every known home's to ``load_config``
(``home_options``), which parses, validates and reports them like the rest
and keeps their values in ``FiberdConfig.home_options``. ``fiberd --help`` and
the man page list them with the rest.

List options (trust, devices, allowed_uids, allowed_gids) are TOML arrays
(trust: a table) and comma-separated in the environment and flags; a trust
entry there is ``issuer=path``, split at its last "=" (issuer URLs may hold one).
Switches (strict_limits) are TOML booleans, ``true``/``false`` (also
``1``/``0``, ``yes``/``no``, ``on``/``off``) in the environment, and a bare
``--strict-limits`` / ``--no-strict-limits`` flag.

fiberd refuses a state, socket or audit-log dir that anyone but its uid or root
could change, and makes the ones it creates 0700. With allowed_uids or
allowed_gids the socket is 0666 in a dir fiberd opens for search (0711) and the
peer's credentials decide, supplementary groups included (docs/socket-protocol.md).
"""

from __future__ import annotations

import difflib
import grp
import ipaddress
import math
import os
import pwd
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from slurm_fiber import defaults
from slurm_fiber.core.devices import Device

ENV_PREFIX = "FIBERD_"
CONFIG_ENV = "FIBERD_CONFIG"
_NONE_WORDS = ("none", "")


class ConfigError(Exception):
    """A refused configuration value: ``option``, ``source`` and a one-line ``reason``."""

    def __init__(self, option: str, source: str, reason: str) -> None:
        super().__init__(f"{option} (from {source}): {reason}")
        self.option = option
        self.source = source
        self.reason = reason


class _Refused(ValueError):
    """A parser's refusal; the loader adds the option and its source."""


OptionRefused = _Refused  # what a home's option parser raises (one line, no option name)


def text_value(value: object) -> str:
    """The parser of a text option (TOML string or text), stripped; a home's parsers build
    on it. Raises OptionRefused."""
    return _text(value)


@dataclass(frozen=True)
class FiberdConfig:
    """Every fiberd option, validated, paths absolute. Build it with ``load_config``."""

    home: str = "standalone"
    state_dir: str = str(defaults.STATE_DIR)
    socket: str = ""
    audit_path: str = ""
    audit_fsync: str = "always"
    trust: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    audience: str | None = None
    leeway: float = 30.0
    stale_ttl: float = 60.0
    fence_ttl: float = 120.0
    grantdir: str = ""
    poll_interval: float = 1.0
    cgroup_root: str | None = "delegate"
    cgroup_backend: str = "auto"
    devices: tuple[Device, ...] = ()
    ready_file: str | None = ""
    allowed_uids: tuple[int, ...] = ()
    allowed_gids: tuple[int, ...] = ()
    grace: float = 5.0
    spares: int = 2  # two Clones arriving together (-j2 on two cores) both find one
    spares_idle: float = 300.0  # a grant not cloned for this long holds its template alone
    history: int = 1000  # ended fibers' records kept (inspect, ls --all)
    history_seconds: float = 3600.0  # ... for this long after they ended
    strict_limits: bool = False
    fiber_user: str | None = None  # a root fiberd's: whom fibers run as (core/identity.py)
    template_timeout: float = 10.0
    task_window: str = "fiberd"  # "template": the task-window prototype (design §4)
    log_format: str = "text"
    log_level: str = "info"
    metrics_listen: tuple[str, int] | None = None
    metrics_textfile: str | None = None
    # every home option's value (declared by its home, not here), by name
    home_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


# ---- value parsers: each takes a TOML-native value or a string, returns the typed value.


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise _Refused(f"must be a string, got {value!r}")
    return value.strip()


def _choice(*allowed: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        text = _text(value).lower()
        if text not in allowed:
            raise _Refused(f"must be one of {', '.join(allowed)}, got {value!r}")
        return text

    return parse


def _seconds(
    low: float, high: float = math.inf, *, zero_ok: bool = False
) -> Callable[[object], float]:
    def parse(value: object) -> float:
        if isinstance(value, bool):
            raise _Refused(f"must be a number of seconds, got {value!r}")
        try:
            number = float(value) if isinstance(value, int | float | str) else math.nan
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise _Refused(f"must be a number of seconds, got {value!r}")
        if number < low or number > high or (number == 0 and not zero_ok):
            bound = f"between {low:g} and {high:g}" if math.isfinite(high) else "positive"
            raise _Refused(f"must be {bound} seconds, got {value!r}")
        return number

    return parse


def _path(value: object) -> str:
    text = _text(value)
    if not text:
        raise _Refused("must be a path, got an empty string")
    if "\0" in text:
        raise _Refused("must be a path, got a NUL byte")
    return text


def _optional(parse: Callable[[object], Any]) -> Callable[[object], Any]:
    """``none`` (or an empty string) means unset."""

    def parse_optional(value: object) -> Any:
        if isinstance(value, str) and value.strip().lower() in _NONE_WORDS:
            return None
        return parse(value)

    return parse_optional


_HOME_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


def _home(value: object) -> str:
    """A home's name as the registry spells it. Which names exist is the registry's to say
    (homes.select, a layer above this one): it refuses an unknown one, listing the known."""
    text = _text(value).lower()
    if not _HOME_NAME.match(text):
        raise _Refused(f"must be a home's name (e.g. standalone, slurm, kubernetes), "
                       f"got {value!r}")
    return text


def _cgroup_root(value: object) -> str | None:
    text = _text(value)
    if text.lower() in _NONE_WORDS:
        return None
    if text.lower() == "delegate":
        return "delegate"
    return _path(text)


def _user(value: object) -> str:
    """A user's name or uid, as written (``core/runtime/identity.py`` resolves it when fiberd
    starts: a config file is read before the host's accounts matter)."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else _text(value)
    if not text or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\$?", text):
        raise _Refused(f"{text!r} is not a user name or uid")
    return text


_HOST_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[-A-Za-z0-9.]*[A-Za-z0-9])?$")


def _listen(value: object) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPV6]:PORT`` or ``PORT`` alone (then 127.0.0.1): never every
    interface unless the admin names one (``0.0.0.0``). A TOML integer is a port."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else _text(value)
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _Refused(f"{text!r}: [{host}] is not an IPv6 address") from None
    elif not host:
        raise _Refused(f"{text!r} names no host; give HOST:PORT (e.g. 127.0.0.1:9464) or PORT")
    elif ":" in host or not _HOST_NAME.match(host):
        raise _Refused(f"{text!r}: {host!r} is not a host name or address "
                       "(IPv6: [ADDR]:PORT)")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _Refused(f"{text!r}: the port must be a number from 1 to 65535")
    return host, int(port)


def _items(value: object) -> list[object]:
    """A TOML array as it is, a string split on commas (blanks dropped)."""
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    raise _Refused(f"must be a list (TOML array or comma-separated), got {value!r}")


def _device(spec: object) -> Device:
    text = _text(spec)
    parts = text.split(":", 3)
    if len(parts) < 2 or not parts[0] or not parts[1].isdigit():
        raise _Refused(f"device {text!r} is not kind:index[:path[:uuid]] (e.g. gpu:0:/dev/nvidia0)")
    path = parts[2] if len(parts) > 2 and parts[2] else None
    if path is not None and not path.startswith("/"):
        raise _Refused(f"device {text!r}: the path must be absolute")
    uuid = parts[3] if len(parts) > 3 and parts[3] else None
    return Device(parts[0], int(parts[1]), path, uuid)


def _devices(value: object) -> tuple[Device, ...]:
    devices = [_device(item) for item in _items(value)]
    seen: set[tuple[str, int]] = set()
    for d in devices:
        if (d.kind, d.index) in seen:
            raise _Refused(f"device {d.kind}:{d.index} is listed twice")
        seen.add((d.kind, d.index))
    return tuple(devices)


_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")


def _switch(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(value).lower()
    if text in _TRUE_WORDS or text in _FALSE_WORDS:
        return text in _TRUE_WORDS
    raise _Refused(f"must be true or false, got {value!r}")


def _count(low: int, high: int) -> Callable[[object], int]:
    def parse(value: object) -> int:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise _Refused(f"must be a whole number from {low} to {high}, got {value!r}")
        return value

    return parse


def _ids(lookup: Callable[[str], int], what: str) -> Callable[[object], tuple[int, ...]]:
    def parse(value: object) -> tuple[int, ...]:
        out: list[int] = []
        for item in _items(value):
            if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                out.append(item)
            elif isinstance(item, str) and item.isdigit():
                out.append(int(item))
            elif isinstance(item, str) and item:
                try:
                    out.append(lookup(item))
                except KeyError:
                    raise _Refused(f"no {what} named {item!r} on this host") from None
            else:
                raise _Refused(f"{item!r} is not a {what} id or name")
        return tuple(sorted(set(out)))

    return parse


def _trust(value: object) -> dict[str, str]:
    pairs: list[tuple[object, object]]
    if isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        pairs = []
        for item in _items(value):
            issuer, sep, path = _text(item).rpartition("=")
            if not sep or not issuer:
                raise _Refused(f"{item!r} is not issuer=/path/to/jwks.json")
            pairs.append((issuer, path))
    trust: dict[str, str] = {}
    for who, where in pairs:
        name = _text(who)
        if not name:
            raise _Refused("an issuer name is empty")
        trust[name] = _path(where)
    return trust


# ---- the option table


@dataclass(frozen=True)
class Option:
    """One option: its name (the TOML key), parser, whether it is a path, and its help line."""

    name: str
    parse: Callable[[object], Any]
    help: str
    paths: bool = False  # its value holds paths made absolute against the source's directory
    switch: bool = False  # a boolean: a bare --flag / --no-flag on the command line
    default: Any = None  # a home option's default (fiberd's own: FiberdConfig's field)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("home", _home, "where fiberd runs: a home's name (fiberd --help lists them)"),
    Option("state_dir", _path, "fiberd's state; the default of socket, audit, grantdir, ready",
           paths=True),
    Option("socket", _path, "the local API's Unix socket", paths=True),
    Option("audit_path", _path, "the audit log, one JSON line per decision", paths=True),
    Option("audit_fsync", _choice("always", "never"),
           "always: fsync each decision's record before answering (a fiber's exit shares "
           "the next fsync, within 0.1 s); never: leave it to the kernel"),
    Option("trust", _trust, "issuer=JWKS file pairs (TOML: a table)", paths=True),
    Option("audience", _optional(_text), "the aud tokens must contain (unset: the home names it)"),
    Option("leeway", _seconds(0, 300, zero_ok=True), "seconds of skew allowed on nbf/iat"),
    Option("stale_ttl", _seconds(0), "seconds of control-plane silence until the source is stale"),
    Option("fence_ttl", _seconds(0), "seconds after the last sync a fence ends (>= stale_ttl)"),
    Option("grantdir", _path, "directory polled for *.jwt grant files", paths=True),
    Option("poll_interval", _seconds(0), "seconds between grantdir polls"),
    Option("cgroup_root", _cgroup_root, "delegate, a cgroup v2 directory, or none", paths=True),
    Option("cgroup_backend", _choice("auto", "v2", "v1", "hybrid"),
           "auto, v2, v1 or hybrid: where limits, devices and stop live"),
    Option("devices", _devices, "static devices kind:index[:path[:uuid]], comma-separated"),
    Option("ready_file", _optional(_path), "readiness JSON, replaced atomically (none: no file)",
           paths=True),
    Option("allowed_uids", _ids(lambda n: pwd.getpwnam(n).pw_uid, "user"),
           "users (ids or names) besides fiberd's own allowed on the socket"),
    Option("allowed_gids", _ids(lambda n: grp.getgrnam(n).gr_gid, "group"),
           "groups (ids or names) whose members are allowed on the socket"),
    Option("grace", _seconds(0, 3600, zero_ok=True), "seconds between SIGTERM and SIGKILL"),
    Option("spares", _count(0, 16),
           "fiber processes each ready template forks ahead, from its grant's first Clone "
           "on (0: fork on each Clone)"),
    Option("spares_idle", _seconds(0, 86400, zero_ok=True),
           "seconds without a Clone after which a grant's spares are "
           "dismissed, until its next Clone (0: kept while the grant lives)"),
    Option("history", _count(0, 100000),
           "ended fibers whose last records inspect and ls --all still show (0: none)"),
    Option("history_seconds", _seconds(1, 7 * 86400),
           "seconds an ended fiber's record stays visible"),
    Option("strict_limits", _switch,
           "refuse (unenforceable) a grant asking for limits this host does not enforce",
           switch=True),
    Option("fiber_user", _optional(_user),
           "root fiberd: the unprivileged user (name or uid) templates and fibers run as, "
           "without capabilities; \"root\" to keep them root (say so explicitly)"),
    Option("template_timeout", _seconds(0.1, 3600),
           "seconds a template may take to answer (or stay stopped) before it is killed "
           "and re-warmed"),
    Option("task_window", _choice("fiberd", "template"),
           "fiberd: fiberd starts each item of a windowed batch; template (a prototype, "
           "off by default): the template runs a windowed batch of exec items itself, "
           "reporting starts and ends in batches"),
    Option("log_format", _choice("text", "json"), "text or json"),
    Option("log_level", _choice("debug", "info", "warning", "error"),
           "debug, info, warning or error"),
    Option("metrics_listen", _optional(_listen),
           "serve Prometheus metrics over HTTP GET /metrics on HOST:PORT "
           "(PORT alone: 127.0.0.1; none: off)"),
    Option("metrics_textfile", _optional(_path),
           "write the metrics for node_exporter's textfile collector into this directory "
           "(none: off)", paths=True),
)
_BY_NAME = {opt.name: opt for opt in OPTIONS}
_DERIVED = {  # unset path options default to a name inside state_dir
    "socket": defaults.SOCKET_NAME,
    "audit_path": defaults.AUDIT_NAME,
    "grantdir": defaults.GRANTDIR_NAME,
    "ready_file": defaults.READY_NAME,
}


def default_text(opt: Option) -> str:
    """How the option's default reads in help ("STATE_DIR/fiberd.sock", "30", "none")."""
    if opt.name in _DERIVED:
        return f"STATE_DIR/{_DERIVED[opt.name]}"
    if opt.name not in _BY_NAME:
        return _show(opt.default)  # a home's option
    return _show(getattr(FiberdConfig(), opt.name))


def describe() -> str:
    """Every option with its flag, environment variable, default and meaning (for --help)."""
    return "\n".join(f"{opt.flag:16} {opt.env:22} [{default_text(opt)}] {opt.help}"
                     for opt in OPTIONS)


def _show(value: object) -> str:
    if value is None or value == () or value == {}:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


# ---- loading


def load_config(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
    *,
    home_defaults: Mapping[str, object] | None = None,
    home_source: str = "the home",
    home_options: Sequence[Option] = (),
) -> FiberdConfig:
    """Build fiberd's configuration from defaults, a TOML file, the environment and flags.

    ``path`` is the ``--config`` file (else ``FIBERD_CONFIG``, else none);
    ``env`` defaults to ``os.environ``; ``flags`` maps option names to the
    values given on the command line (None: not given). ``home_defaults``
    are values a home implies (a Slurm job's state dir), above the built-in
    defaults and below everything else; ``home_source`` names them in
    refusals. ``home_options`` are the homes' own options (``homes.select.load_config``
    passes every known home's), taken from every source like fiberd's own and
    kept in ``home_options``. Blocks to read the file. Raises ConfigError with a one-line
    reason naming the option and its source; never returns a half-valid
    configuration.
    """
    env = os.environ if env is None else env
    path = path or env.get(CONFIG_ENV) or None
    table = {**{opt.name: opt for opt in home_options}, **_BY_NAME}
    values: dict[str, tuple[object, str]] = {}  # option -> (parsed value, source)
    for name, raw in (home_defaults or {}).items():
        if name not in table:
            raise _unknown(name, home_source, list(table))
        values[name] = _parse(table[name], _flag_value(raw), home_source, os.getcwd())
    if path is not None:
        values.update(_from_file(path, table))
    values.update(_from_env(env, table))
    values.update(_from_flags(flags or {}, table))
    own = {opt.name: values.pop(opt.name, (opt.default, ""))[0]
           for opt in home_options if opt.name not in _BY_NAME}
    return _build(values, own)


def _parse(opt: Option, raw: object, source: str, base: str) -> tuple[object, str]:
    try:
        value = opt.parse(raw)
    except _Refused as err:
        raise ConfigError(opt.name, source, str(err)) from None
    return (_absolute(value, base) if opt.paths else value), source


def _absolute(value: Any, base: str) -> Any:
    if isinstance(value, str) and value != "delegate":
        return os.path.normpath(os.path.join(base, value))
    if isinstance(value, dict):
        return {k: _absolute(v, base) for k, v in value.items()}
    return value


def _unknown(option: str, source: str, candidates: list[str]) -> ConfigError:
    near = difflib.get_close_matches(option, candidates, n=1)
    hint = f"; did you mean {near[0]}?" if near else ""
    return ConfigError(option, source, f"is not a fiberd option{hint}")


def _from_file(path: str, table: Mapping[str, Option]) -> dict[str, tuple[object, str]]:
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as err:
        raise ConfigError("config", path, f"cannot read the file: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("config", path, f"is not valid TOML: {err}") from None
    base = os.path.dirname(os.path.abspath(path))
    out: dict[str, tuple[object, str]] = {}
    for key, raw in document.items():
        source = f"{path}:{key}"
        opt = table.get(key)
        if opt is None:
            raise _unknown(key, source, list(table))
        out[key] = _parse(opt, raw, source, base)
    return out


def _from_env(env: Mapping[str, str],
              table: Mapping[str, Option]) -> dict[str, tuple[object, str]]:
    known = {opt.env: opt for opt in table.values()}
    out: dict[str, tuple[object, str]] = {}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX) or var == CONFIG_ENV:
            continue
        opt = known.get(var)
        if opt is None:
            raise _unknown(var, "the environment", [*known, CONFIG_ENV])
        out[opt.name] = _parse(opt, raw, var, os.getcwd())
    return out


def _from_flags(flags: Mapping[str, object],
                table: Mapping[str, Option]) -> dict[str, tuple[object, str]]:
    out: dict[str, tuple[object, str]] = {}
    for name, raw in flags.items():
        if raw is None:
            continue
        opt = table.get(name)
        if opt is None:
            raise _unknown(name, "the command line", list(table))
        out[name] = _parse(opt, _flag_value(raw), opt.flag, os.getcwd())
    return out


def _flag_value(raw: object) -> object:
    """Typer hands numbers and lists typed; parsers take TOML-native values or strings."""
    return list(raw) if isinstance(raw, tuple) else raw


def _build(values: dict[str, tuple[object, str]], own: dict[str, Any]) -> FiberdConfig:
    chosen: dict[str, Any] = {name: value for name, (value, _) in values.items()}
    chosen["home_options"] = MappingProxyType(own)
    state_dir = str(chosen.get("state_dir", FiberdConfig.state_dir))
    for name, leaf in _DERIVED.items():
        if name not in chosen:
            chosen[name] = os.path.join(state_dir, leaf)
    if "trust" in chosen:
        chosen["trust"] = MappingProxyType(dict(chosen["trust"]))
    config = FiberdConfig(**chosen)
    if config.fence_ttl < config.stale_ttl:
        _, source = values.get("fence_ttl") or values.get("stale_ttl") or (None, "defaults")
        raise ConfigError(
            "fence_ttl", source,
            f"fence_ttl ({config.fence_ttl:g} s) must not be shorter than stale_ttl "
            f"({config.stale_ttl:g} s)",
        )
    return config

