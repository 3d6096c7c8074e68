"""fiberd's command-line options, generated from the configuration's option table.

Every option of ``slurm_fiber.config.OPTIONS``, and every home's own
(``homes.select.home_options``), becomes a ``--flag VALUE`` (a switch: a bare
``--flag`` / ``--no-flag``) whose help names its environment variable, so each
table stays the one place its options are described.
``fiberd`` and ``fiberd-run`` share them. ``load_from_flags`` turns the
parsed flags into a ``FiberdConfig``.

``plain_flags`` parses a command line made only of these flags, as typer would,
without importing typer (kept out of fiberd: core/runtime/memory.py); anything else
(``--help``, an unknown flag, a value that looks like a flag) is left to typer,
which parses and explains it.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from slurm_fiber.config import OPTIONS, FiberdConfig, Option, default_text, load_config
from slurm_fiber.homes.select import home_defaults, home_options

KW = inspect.Parameter.KEYWORD_ONLY
CONFIG_HELP = "TOML file of options (env FIBERD_CONFIG); flags and env override it"
# Words that start with "-" and are still values, as argparse takes them: "-", a negative number.
DASH_VALUE = re.compile(r"-|-\d+|-\d*\.\d+")


def all_options() -> tuple[Option, ...]:
    """fiberd's own options, then every known home's (``homes.select.home_options``)."""
    return (*OPTIONS, *home_options())


def option_parameters() -> list[inspect.Parameter]:
    """``--config`` and one parameter per configuration option, all optional strings
    (typer's declarations: imported here, only when typer parses)."""
    import typer

    params = [inspect.Parameter("config", KW, annotation=str | None, default=typer.Option(
        None, "--config", metavar="FILE", help=CONFIG_HELP, show_default=False))]
    for opt in all_options():
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


def plain_flags(argv: Sequence[str], extra: Mapping[str, bool] | None = None
                ) -> dict[str, object] | None:
    """``argv`` parsed as typer parses ``option_parameters()`` (and the ``extra`` options:
    flag -> whether it is a bare switch, False when absent), keyed by parameter name
    (values are strings, switches bools, absent ones None; the last of a repeated flag
    wins); None when it is anything else (typer's to parse): an unknown word, a value
    missing or starting with "-" (but "-" and a negative number), ``--switch=VALUE``.
    Flags are matched whole (no abbreviations), ``--flag VALUE`` or ``--flag=VALUE``; a
    switch is ``--flag`` or ``--no-flag``."""
    valued = {"--config": "config"}
    negatable: dict[str, str] = {}
    bare: dict[str, str] = {}
    parsed: dict[str, object] = {"config": None}
    for opt in all_options():
        (negatable if opt.switch else valued)[opt.flag] = opt.name
        parsed[opt.name] = None
    for flag, switch in (extra or {}).items():
        name = flag.removeprefix("--").replace("-", "_")
        (bare if switch else valued)[flag] = name
        parsed[name] = False if switch else None
    words = iter(argv)
    for word in words:
        flag, eq, value = word.partition("=")
        if flag in valued:
            if not eq:
                value = next(words, "--")
                if value.startswith("-") and not DASH_VALUE.fullmatch(value):
                    return None
            parsed[valued[flag]] = value
        elif eq:
            return None
        elif word in negatable or word in bare:
            parsed[negatable.get(word) or bare[word]] = True
        elif word.startswith("--no-") and f"--{word[5:]}" in negatable:
            parsed[negatable[f"--{word[5:]}"]] = False
        else:
            return None
    return parsed


def with_parameters(fn: Callable[..., Any], params: list[inspect.Parameter]) -> Callable[..., Any]:
    """Give ``fn(**kwargs)`` the signature typer reads its options from."""
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return fn


def load_from_flags(flags: Mapping[str, object],
                    home_defaults: Mapping[str, object] | None = None) -> FiberdConfig:
    """The configuration from ``--config``, the environment and the option flags in ``flags``.

    Raises ConfigError (one line naming the option and its source).
    """
    options = all_options()
    names = {opt.name for opt in options}
    return load_config(str(flags["config"]) if flags.get("config") else None,
                       flags={k: v for k, v in flags.items() if k in names},
                       home_defaults=home_defaults, home_source=f"the {flags.get('home')} home",
                       home_options=options[len(OPTIONS):])


def resolve_config(flags: Mapping[str, object], environ: Mapping[str, str]) -> FiberdConfig:
    """Load the configuration, then again with the chosen home's implied defaults.

    Raises ConfigError, or HomeRefused when the home's defaults cannot be had.
    """
    first = load_from_flags(flags)
    implied = home_defaults(first.home, environ)
    return load_from_flags(flags, implied) if implied else first
