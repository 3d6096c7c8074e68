"""MkDocs hook: the reference pages generated from the code at each build.

- ``reference/commands/PROG.md``: every command's and subcommand's ``--help``, from its
  parser (slurm_fiber.cli.reference, which also makes the man pages and completion);
- ``reference/configuration.md``: fiberd's options table and rules, from
  slurm_fiber.config's contract;
- ``reference/exit-codes.md``: fiberctl's exit codes from its constants, and each
  command's own "Exit codes" line from its help;
- ``changelog.md``: CHANGELOG.md.

Nothing is written into docs/: the pages are added to the build's file list only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, text in pages().items():
        files.append(File.generated(config, path, content=text))
    return files


def pages() -> dict[str, str]:
    from slurm_fiber.cli.reference import COMMANDS, model, render_markdown

    out = {f"reference/commands/{prog}.md": render_markdown(prog, model(prog))
           for prog in COMMANDS}
    out["reference/configuration.md"] = configuration()
    out["reference/exit-codes.md"] = exit_codes(COMMANDS, model)
    out["changelog.md"] = (ROOT / "CHANGELOG.md").read_text()
    return out


def configuration() -> str:
    import slurm_fiber.config

    doc = slurm_fiber.config.__doc__ or ""
    body = doc.split("\n", 1)[1].strip()
    body = re.sub(r"``([^`]+)``", r"`\1`", body)
    return ("# Configuration\n\nfiberd's options, generated from `slurm_fiber.config` at "
            "the docs' build. Each is a flag (`--option-name`), a TOML key (`--config "
            "FILE`) and an environment variable (`FIBERD_OPTION_NAME`); `fiberd --help` "
            "prints the same.\n\n" + body + "\n")


def exit_codes(commands: dict[str, Any], model: Any) -> str:
    from slurm_fiber.client import fiberctl

    rows = [(value, name) for name, value in vars(fiberctl).items()
            if name.startswith("EXIT_") and isinstance(value, int)]
    lines = ["# Exit codes", "", "Generated from the code at the docs' build. One table holds "
             "for every command (0 success, 1 refused or failed with one line on stderr "
             "saying why, 2 usage error); `fiberctl` adds its own codes, and `fiberctl "
             "run` and `fiberd-run -- CMD` exit with the fiber's own status.", "",
             "## fiberctl's constants", "", "| code | constant |", "|---|---|"]
    lines += [f"| {value} | `{name}` |" for value, name in sorted(rows)]
    lines += ["", "## Each command's help", ""]
    for prog in commands:
        for cmd in model(prog).walk():
            said = " ".join(cmd.help_text.split())
            found = re.search(r"([Ee]xit codes?:.*?)(?:$|Options:|Commands:|Arguments:|positional|"
                              r"options:)", said)
            if found:
                lines.append(f"- `{cmd.name}`: {found.group(1).strip()}")
    return "\n".join(lines) + "\n"
