"""Man pages, shell completion and the docs' command reference, generated from the parsers.

Every command's parser (typer/click for ``slurm-fiber``, ``fiberd``,
``fiberd-run`` and the two hooks; argparse for ``fiberctl`` and ``fiberctl
map``) is read into one model (``Cmd``: name, help, options, subcommands), and
each output is rendered from that model, so a flag added to a parser shows in
its man page, its completion and the docs at the next build with nothing else
to edit. The wheel's build runs ``python -m slurm_fiber.cli.reference build
DIR`` (setup.py); the docs site's build runs ``markdown DIR``. Nothing here runs
when a command runs.

``build DIR`` writes ``DIR/man/man{1,8}/PROG.N``, ``DIR/completion/bash/PROG``
(for bash-completion's ``completions/`` dir) and ``DIR/completion/zsh/_PROG``
(for a dir on ``$fpath``). Completion is static: subcommands and options, with
files completed where an option takes a path; no Python runs at a Tab.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_fiber.version import version


@dataclass
class Opt:
    """One option: its flags, its value's name (None: a flag) and one help line."""

    flags: list[str]
    metavar: str | None
    help: str


@dataclass
class Cmd:
    """A command or subcommand: what ``--help`` shows, as data."""

    name: str  # the full invocation: "fiberctl run"
    summary: str
    help_text: str  # the whole --help output
    description: str
    options: list[Opt] = field(default_factory=list)
    commands: list[Cmd] = field(default_factory=list)

    def walk(self) -> Iterator[Cmd]:
        yield self
        for sub in self.commands:
            yield from sub.walk()


_PATHY = re.compile(r"PATH|FILE|DIR|CONFIG|SOCKET|TOKEN", re.I)


def _type_name(param: Any, ctx: Any) -> str:
    """An option's value name as its help shows it (click's ``type.name``; recent typer's
    ``display_type(ctx)``)."""
    kind = getattr(param, "type", None)
    if kind is not None:
        return str(kind.name).upper()
    try:
        return str(param.display_type(ctx)).upper() or "VALUE"
    except Exception:
        return "VALUE"


def from_click(command: Any, name: str, parent: Any = None) -> Cmd:
    """The model of a click command (typer builds click commands)."""
    ctx = command.context_class(command, info_name=name.rsplit(" ", 1)[-1], parent=parent)
    options = []
    for param in command.params:
        if getattr(param, "hidden", False) or param.param_type_name != "option":
            continue
        flags = [*param.opts, *param.secondary_opts]
        metavar = None if param.is_flag else (param.metavar or _type_name(param, ctx))
        options.append(Opt(flags, metavar, " ".join((param.help or "").split())))
    if not any("--help" in o.flags for o in options):
        options.append(Opt(["--help"], None, "Show this message and exit."))
    help_text = command.get_help(ctx)
    cmd = Cmd(name, command.get_short_help_str(limit=80), help_text,
              (command.help or "").replace("\b\n", ""), options)
    lister = getattr(command, "list_commands", None)
    if lister is not None:
        for sub_name in lister(ctx):
            sub = command.get_command(ctx, sub_name)
            if sub is not None and not getattr(sub, "hidden", False):
                cmd.commands.append(from_click(sub, f"{name} {sub_name}", ctx))
    return cmd


def from_argparse(parser: argparse.ArgumentParser, name: str,
                  summary: str = "") -> Cmd:
    """The model of an argparse parser (subparsers become subcommands)."""
    cmd = Cmd(name, summary, parser.format_help(), parser.description or "")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in action._choices_actions}
            for sub_name, sub in action.choices.items():
                cmd.commands.append(from_argparse(sub, f"{name} {sub_name}",
                                                  helps.get(sub_name, "")))
        elif action.option_strings and action.help != argparse.SUPPRESS:
            metavar = None if action.nargs == 0 else str(action.metavar or action.dest.upper())
            cmd.options.append(Opt(list(action.option_strings), metavar,
                                   " ".join((action.help or "").replace("%%", "%").split())))
    return cmd


def _slurm_fiber() -> Cmd:
    import typer.main

    from slurm_fiber.cli.main import app

    return from_click(typer.main.get_command(app), "slurm-fiber")


def _typer_single(app: Any, name: str) -> Cmd:
    import typer.main

    return from_click(typer.main.get_command(app), name)


def _fiberd() -> Cmd:
    from slurm_fiber.cli.fiberd import typer_app

    return _typer_single(typer_app(), "fiberd")


def _fiberd_run() -> Cmd:
    from slurm_fiber.cli.fiberd_run import typer_app

    return _typer_single(typer_app(), "fiberd-run")


def _fiberctl() -> Cmd:
    from slurm_fiber.client.fiberctl import build_parser
    from slurm_fiber.client.fibermap import build_parser as map_parser

    cmd = from_argparse(build_parser(), "fiberctl")
    for i, sub in enumerate(cmd.commands):
        if sub.name == "fiberctl map":  # listed for --help only; its own parser has the rest
            cmd.commands[i] = from_argparse(map_parser(), "fiberctl map", sub.summary)
    return cmd


def _hook(module: str) -> Callable[[], Cmd]:
    def load() -> Cmd:
        import importlib

        from slurm_fiber.hooks.cli import hook_app

        hook = importlib.import_module(module)
        return _typer_single(hook_app(hook.NAME, hook.__doc__ or hook.NAME,
                                      hook.run_prolog if "prolog" in module
                                      else hook.run_epilog), hook.NAME)
    return load


# Every console script: (man section, one-line purpose for NAME, its model's loader).
COMMANDS: dict[str, tuple[int, str, Callable[[], Cmd]]] = {
    "slurm-fiber": (1, "slurm_fiber admin tools: keys, tokens, leases, audit, conformance",
                    _slurm_fiber),
    "fiberd": (8, "the per-allocation daemon that verifies grants and forks fibers", _fiberd),
    "fiberd-run": (1, "run fiberd for a job step, optionally with one command", _fiberd_run),
    "fiberctl": (1, "run, call, map and inspect fibers of this job's fiberd", _fiberctl),
    "slurm-fiber-prolog": (8, "the Slurm prolog of slurm_fiber (run by slurmd as root)",
                           _hook("slurm_fiber.prolog.main")),
    "slurm-fiber-epilog": (8, "the Slurm epilog of slurm_fiber (run by slurmd as root)",
                           _hook("slurm_fiber.epilog.main")),
}


def model(prog: str) -> Cmd:
    """The model of console script ``prog``, with ``--version`` where its fast path
    answers it before any parser (fiberd, fiberd-run: slurm_fiber.version)."""
    cmd = COMMANDS[prog][2]()
    if not any("--version" in o.flags for o in cmd.options):
        cmd.options.append(Opt(["--version"], None, "Print the version and exit."))
    return cmd


# ------------------------------------------------------------------ man pages (roff)

def _roff(text: str) -> str:
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(("\\&" + line) if line.startswith((".", "'")) else line
                     for line in text.splitlines())


def _paragraphs(text: str) -> str:
    out = []
    for para in re.split(r"\n\s*\n", text.strip()):
        lines = para.splitlines()
        if len(lines) > 1 and all(line.startswith((" ", "\t")) or not line.strip()
                                  for line in lines[1:]):
            out.append(".nf\n" + _roff(para) + "\n.fi")  # a table or example: as written
        elif any(line.startswith("  ") for line in lines):
            out.append(".nf\n" + _roff(para) + "\n.fi")
        else:
            out.append(_roff(" ".join(line.strip() for line in lines)))
    return "\n.PP\n".join(out)


def _option_items(options: list[Opt]) -> str:
    items = []
    for opt in options:
        head = ", ".join(f"\\fB{_roff(f)}\\fR" for f in opt.flags)
        if opt.metavar:
            head += f" \\fI{_roff(opt.metavar)}\\fR"
        items.append(f".TP\n{head}\n{_roff(opt.help) or '.'}")
    return "\n".join(items)


def _plain_rst(text: str) -> str:
    """Docstring markup (``code``) as plain text."""
    return text.replace("``", "")


def render_man(prog: str, cmd: Cmd, today: datetime.date | None = None) -> str:
    """Command ``prog``'s man page (roff, man(7) macros)."""
    section, purpose, _ = COMMANDS[prog]
    day = (today or datetime.date.today()).isoformat()
    parts = [
        f'.TH "{prog.upper()}" "{section}" "{day}" "slurm-fiber {version()}" '
        f'"slurm_fiber manual"',
        ".SH NAME", f"{_roff(prog)} \\- {_roff(purpose)}",
        ".SH SYNOPSIS", ".nf", _roff(_usage(cmd)), ".fi",
        ".SH DESCRIPTION", _paragraphs(_plain_rst(cmd.description)),
        ".SH OPTIONS", _option_items(cmd.options),
    ]
    if cmd.commands:
        parts.append(".SH COMMANDS")
        for sub in cmd.walk():
            if sub is cmd:
                continue
            parts.append(f'.SS "{_roff(sub.name)}"')
            parts.append(_roff(" ".join(_plain_rst(sub.summary or sub.description)
                                        .split()[:60])))
            if sub.options:
                parts.append(".RS\n" + _option_items(sub.options) + "\n.RE")
    others = [f"\\fB{_roff(p)}\\fR({COMMANDS[p][0]})" for p in COMMANDS if p != prog]
    parts += [".SH SEE ALSO", ", ".join(others)]
    return "\n".join(parts) + "\n"


def _usage(cmd: Cmd) -> str:
    for line in cmd.help_text.splitlines():
        if line.lower().startswith("usage:"):
            return line.split(":", 1)[1].strip()
    return cmd.name + " [OPTIONS]"


# ------------------------------------------------------------------ completion

def _words(cmd: Cmd) -> list[str]:
    return [f for o in cmd.options for f in o.flags]


def render_bash(prog: str, cmd: Cmd) -> str:
    """A bash completion script for ``prog`` (static: subcommands and options)."""
    fn = "_" + re.sub(r"\W", "_", prog)
    cases = []
    for sub in cmd.walk():
        path = sub.name.split()[1:]
        children = [c.name.split()[-1] for c in sub.commands]
        valued = [f for o in sub.options if o.metavar for f in o.flags]
        pathy = [f for o in sub.options if o.metavar and _PATHY.search(o.metavar)
                 for f in o.flags]
        cases.append(f'    "{" ".join(path)}")\n'
                     f'      words_="{" ".join(children + _words(sub))}"\n'
                     f'      valued_="{" ".join(valued)}"; pathy_="{" ".join(pathy)}" ;;')
    return f"""# bash completion for {prog} (slurm-fiber {version()}), generated from its parser
{fn}() {{
  local cur prev path="" w words_ valued_ pathy_ i
  cur=${{COMP_WORDS[COMP_CWORD]}}; prev=${{COMP_WORDS[COMP_CWORD-1]}}
  for ((i = 1; i < COMP_CWORD; i++)); do
    w=${{COMP_WORDS[i]}}
    [[ $w == -- ]] && return 0
    [[ $w == -* ]] && continue
    case " $({fn}_children "$path") " in *" $w "*) path="${{path:+$path }}$w" ;; esac
  done
  {fn}_table "$path"
  if [[ " $valued_ " == *" $prev "* ]]; then
    [[ " $pathy_ " == *" $prev "* ]] && COMPREPLY=($(compgen -f -- "$cur"))
    return 0
  fi
  COMPREPLY=($(compgen -W "$words_" -- "$cur"))
}}
{fn}_children() {{
  {fn}_table "$1"; local x out=""
  for x in $words_; do [[ $x == -* ]] || out="$out $x"; done
  echo "$out"
}}
{fn}_table() {{
  case "$1" in
{chr(10).join(cases)}
    *) words_=""; valued_=""; pathy_="" ;;
  esac
}}
complete -o default -F {fn} {prog}
"""


def _zsh_quote(text: str) -> str:
    return text.replace("'", "'\\''").replace("[", "\\[").replace("]", "\\]").replace(":", "\\:")


def _zsh_specs(cmd: Cmd) -> list[str]:
    specs = []
    for opt in cmd.options:
        helptext = _zsh_quote(opt.help.split(". ")[0][:70])
        value = ""
        if opt.metavar:
            action = "_files" if _PATHY.search(opt.metavar) else " "
            value = f":{_zsh_quote(opt.metavar)}:{action}"
        names = "{" + ",".join(opt.flags) + "}" if len(opt.flags) > 1 else opt.flags[0]
        excl = f"({' '.join(opt.flags)})" if len(opt.flags) > 1 else ""
        specs.append(f"'{excl}'{names}'[{helptext}]{value}'" if excl
                     else f"'{names}[{helptext}]{value}'")
    return specs


def render_zsh(prog: str, cmd: Cmd) -> str:
    """A zsh completion function ``_prog`` (static: subcommands and options)."""
    fn = "_" + re.sub(r"\W", "_", prog)
    bodies = []
    for sub in cmd.walk():
        name = fn + "".join("__" + re.sub(r"\W", "_", p) for p in sub.name.split()[1:])
        specs = _zsh_specs(sub)
        if sub.commands:
            listing = " ".join(f"'{c.name.split()[-1]}:{_zsh_quote(c.summary[:60])}'"
                               for c in sub.commands)
            body = (f"  local -a subs=({listing})\n  local state line\n"
                    f"  _arguments -C {' '.join(specs)} '1: :->cmd' '*:: :->args'\n"
                    f"  case $state in\n    cmd) _describe command subs ;;\n"
                    f"    args) (( $+functions[{name}__$line[1]] )) && {name}__$line[1] ;;\n"
                    f"  esac")
        else:
            body = f"  _arguments {' '.join(specs)} '*::arg:_default'"
        bodies.append(f"{name}() {{\n{body}\n}}")
    return (f"#compdef {prog}\n# zsh completion for {prog} (slurm-fiber {version()}), "
            f"generated from its parser\n" + "\n".join(bodies) + f'\n{fn} "$@"\n')


# ------------------------------------------------------------------ docs (Markdown)

def render_markdown(prog: str, cmd: Cmd) -> str:
    """The docs' reference page of ``prog``: every (sub)command's --help, as printed."""
    section, purpose, _ = COMMANDS[prog]
    out = [f"# {prog}({section})", "", f"{purpose[0].upper()}{purpose[1:]}. Generated from "
           "its parser at the docs' build (`--help` of each command).", ""]
    for sub in cmd.walk():
        out += [f"## `{sub.name}`" if sub is not cmd else "## `--help`", "", "```text",
                sub.help_text.rstrip(), "```", ""]
    return "\n".join(out)


def build(target: Path) -> list[Path]:
    """Write every man page and completion script under ``target``; the paths written."""
    written = []
    for prog, (section, _purpose, _load) in COMMANDS.items():
        cmd = model(prog)
        for path, text in (
            (target / "man" / f"man{section}" / f"{prog}.{section}", render_man(prog, cmd)),
            (target / "completion" / "bash" / prog, render_bash(prog, cmd)),
            (target / "completion" / "zsh" / f"_{prog}", render_zsh(prog, cmd)),
        ):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
    return written


def markdown(target: Path) -> list[Path]:
    """Write the docs' command reference pages under ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for prog in COMMANDS:
        path = target / f"{prog}.md"
        path.write_text(render_markdown(prog, model(prog)))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm_fiber.cli.reference",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["build", "markdown"])
    parser.add_argument("target", type=Path)
    args = parser.parse_args(argv)
    done = build(args.target) if args.what == "build" else markdown(args.target)
    print(f"wrote {len(done)} files under {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
