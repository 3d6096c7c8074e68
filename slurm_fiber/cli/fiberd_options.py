"""fiberd's command-line options, generated from the configuration's option table.

Every option of ``slurm_fiber.config.OPTIONS`` becomes a ``--flag VALUE`` (a
switch: a bare ``--flag`` / ``--no-flag``) whose help names its environment
variable, so the table stays the one place an option is described.
``fiberd`` and ``fiberd-run`` share them. ``load_from_flags`` turns the
parsed flags into a ``FiberdConfig``.

``plain_flags`` parses a command line made only of these flags with the
standard library, as typer would: typer's own parsing imports pydantic (about
10 MB of a long-running daemon's memory, measured), so the daemons take this
path first and leave typer anything else (``--help``, an unknown flag, a value
that looks like a flag), which it parses and explains as before. Nothing here
imports typer until typer is asked to parse (``option_parameters``): a daemon
started with plain flags never loads it (about 3.5 MB of PSS, measured).
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from slurm_fiber.config import OPTIONS, FiberdConfig, default_text, load_config
from slurm_fiber.homes.select import home_defaults

KW = inspect.Parameter.KEYWORD_ONLY
CONFIG_HELP = "TOML file of options (env FIBERD_CONFIG); flags and env override it"


def option_parameters() -> list[inspect.Parameter]:
    """``--config`` and one parameter per configuration option, all optional strings
    (typer's declarations: imported here, only when typer parses)."""
    import typer

    params = [inspect.Parameter("config", KW, annotation=str | None, default=typer.Option(
        None, "--config", metavar="FILE", help=CONFIG_HELP, show_default=False))]
    for opt in OPTIONS:
        help_text = f"{opt.help} [env {opt.env}; default {default_text(opt)}]"
        if opt.switch:
            flag = f"{opt.flag}/--no-{opt.flag[2:]}"
            params.append(inspect.Parameter(opt.name, KW, annotation=bool | None,
                                            default=typer.Option(None, flag, show_default=False,
                                                                 help=help_text)))
            continue
        params.append(inspect.Parameter(opt.name, KW, annotation=str | None, default=typer.Option(
            None, opt.flag, metavar=opt.name.upper(), show_default=False, help=help_text)))
    return params


class _Declined(Exception):
    """The command line is not plain flags: typer parses it."""


class _PlainParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _Declined(message)


def plain_flags(argv: Sequence[str], extra: Mapping[str, bool] | None = None
                ) -> dict[str, object] | None:
    """``argv`` parsed as typer parses ``option_parameters()`` (and the ``extra`` options:
    flag -> whether it is a bare switch), keyed by parameter name (values are strings,
    switches bools, absent ones None); None when it is anything else (typer's to parse).
    Flags are matched whole (no abbreviations), ``--flag VALUE`` or ``--flag=VALUE``."""
    parser = _PlainParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config")
    for opt in OPTIONS:
        if opt.switch:
            parser.add_argument(opt.flag, dest=opt.name, default=None,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(opt.flag, dest=opt.name)
    for flag, switch in (extra or {}).items():
        parser.add_argument(flag, action="store_true" if switch else "store")
    try:
        parsed, rest = parser.parse_known_args(list(argv))
    except _Declined:
        return None
    return None if rest else vars(parsed)


def with_parameters(fn: Callable[..., Any], params: list[inspect.Parameter]) -> Callable[..., Any]:
    """Give ``fn(**kwargs)`` the signature typer reads its options from."""
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return fn


def load_from_flags(flags: Mapping[str, object],
                    home_defaults: Mapping[str, object] | None = None) -> FiberdConfig:
    """The configuration from ``--config``, the environment and the option flags in ``flags``.

    Raises ConfigError (one line naming the option and its source).
    """
    names = {opt.name for opt in OPTIONS}
    return load_config(str(flags["config"]) if flags.get("config") else None,
                       flags={k: v for k, v in flags.items() if k in names},
                       home_defaults=home_defaults, home_source=f"the {flags.get('home')} home")


def resolve_config(flags: Mapping[str, object], environ: Mapping[str, str]) -> FiberdConfig:
    """Load the configuration, then again with the chosen home's implied defaults.

    Raises ConfigError, or HomeRefused when the home's defaults cannot be had.
    """
    first = load_from_flags(flags)
    implied = home_defaults(first.home, environ)
    return load_from_flags(flags, implied) if implied else first
