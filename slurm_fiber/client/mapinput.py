"""GNU parallel's input sources and replacement strings, for ``fiberctl map``.

What this module guarantees, as GNU parallel (20221122, the release checked against)
does on the same words:

- input sources: ``::: a b`` (values on the command line), ``:::: FILE...`` and
  ``-a FILE`` (one value a line; ``-`` is stdin), ``:::+``/``::::+`` (linked to the
  source before it: the n-th value of each, up to the shorter), stdin lines when no
  source is given (``--range A-B``: the integers, fiberctl's own); several sources
  (or linked groups) combine as every combination, the first source varying slowest;
  ``--colsep REGEX`` splits every value into columns, each an argument of its own;
- a task's arguments are a tuple: ``{}`` is all of them (space-joined inside a longer
  word, one word each when ``{}`` is a word of its own), ``{n}`` the n-th (empty when
  there is none), ``{.}`` ``{/}`` ``{//}`` ``{/.}`` (and ``{n.}`` ...) the path forms,
  ``{#}`` the sequence number, ``{%}`` the job slot; with none anywhere the arguments
  are appended;
- a command given as ONE word holding a space or a shell character is a shell line,
  run as parallel runs it: ``$PARALLEL_SHELL``, else ``$SHELL``, else /bin/sh, ``-c``,
  with each replacement shell-quoted (``shlex.quote``, parallel's own quoting);
  a command of several words runs without a shell (exec), each word as given.

Reads only what the map was given (its files, stdin); never runs anything.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import sys
from collections.abc import Iterator, Sequence

SEPARATORS = (":::", ":::+", "::::", "::::+")
PLACEHOLDER = re.compile(r"\{(?:(\d+)(\.|//|/\.|/)?|(#|%|\.|//|/\.|/)?)\}")
SHELL_CHARS = re.compile(r"[\s|&;<>()$`\\\"'*?\[\]#~=%{}]")
Args = tuple[str, ...]


def split_sources(words: Sequence[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """``words`` cut at the first separator: the words before it, and each source as
    (its separator, its words)."""
    cut = next((i for i, w in enumerate(words) if w in SEPARATORS), len(words))
    head, rest = list(words[:cut]), list(words[cut:])
    sources: list[tuple[str, list[str]]] = []
    for word in rest:
        if word in SEPARATORS:
            sources.append((word, []))
        else:
            sources[-1][1].append(word)
    return head, sources


def read_lines(path: str) -> list[str]:
    """One value a line of ``path`` (``-``: stdin), newline dropped. Raises OSError."""
    if path == "-":
        return [line.rstrip("\n") for line in sys.stdin]
    with open(path) as f:
        return [line.rstrip("\n") for line in f]


def combine(sources: Sequence[tuple[bool, list[str]]], colsep: str | None) -> list[Args]:
    """Every task's arguments from the sources, each (linked to the one before, values):
    linked groups zipped to the shorter, groups combined (the first varies slowest);
    with ``colsep``, each value split into its columns."""
    split = re.compile(colsep) if colsep is not None else None
    columns = [[tuple(split.split(v)) if split else (v,) for v in values]
               for _, values in sources]
    groups: list[list[Args]] = []
    for (linked, _), values in zip(sources, columns, strict=True):
        if linked and groups:
            groups[-1] = [a + b for a, b in zip(groups[-1], values, strict=False)]
        else:
            groups.append(list(values))
    return [sum(combo, ()) for combo in itertools.product(*groups)]


def shell_line(words: Sequence[str]) -> bool:
    """Whether the command is one shell line (one word with a space or shell character)."""
    return len(words) == 1 and bool(SHELL_CHARS.search(PLACEHOLDER.sub("", words[0])))


def shell() -> str:
    """The shell a command line runs in, as parallel picks it (no parent guessing)."""
    return os.environ.get("PARALLEL_SHELL") or os.environ.get("SHELL") or "/bin/sh"


def _form(value: str, kind: str | None) -> str:
    if not kind:
        return value
    base = value.rsplit("/", 1)[-1]
    if kind == ".":
        return _strip_ext(value)
    if kind == "/":
        return base
    if kind == "//":
        return value.rsplit("/", 1)[0] if "/" in value else "."
    return _strip_ext(base)  # "/."


def _strip_ext(path: str) -> str:
    head, _, tail = path.rpartition("/")
    stem = tail.rsplit(".", 1)[0] if "." in tail.lstrip(".") else tail
    return f"{head}/{stem}" if head or path.startswith("/") else stem


def replace(word: str, args: Args, seq: int, slot: int,
            quote: bool = False) -> str:
    """``word`` with every replacement string filled in (``quote``: shell-quoted)."""
    q = shlex.quote if quote else (lambda s: s)

    def fill(m: re.Match[str]) -> str:
        number, numbered_kind, kind = m[1], m[2], m[3]
        if number is not None:
            n = int(number)
            return q(_form(args[n - 1], numbered_kind)) if 0 < n <= len(args) else ""
        if kind == "#":
            return str(seq)
        if kind == "%":
            return str(slot)
        return " ".join(q(_form(a, kind)) for a in args)

    return PLACEHOLDER.sub(fill, word)


def command_words(words: Sequence[str], args: Args, seq: int, slot: int,
                  call: bool) -> list[str]:
    """The task's argv (exec; a shell line: ``[shell, -c, line]``) or string arguments
    (call): replacement strings filled in; with none anywhere, the arguments appended
    (a call with no words gets the arguments)."""
    if not call and shell_line(words):
        line = words[0]
        if not PLACEHOLDER.search(line):
            line = " ".join([line, *(shlex.quote(a) for a in args)])
        return [shell(), "-c", replace(line, args, seq, slot, quote=True)]
    if not any(PLACEHOLDER.search(w) for w in words):
        return [*words, *args]
    out: list[str] = []
    for w in words:
        if w == "{}":
            out.extend(args)  # one word each, as parallel's shell would split them
        else:
            out.append(replace(w, args, seq, slot))
    return out


def shown(words: Sequence[str], call: str | None, line: bool) -> str:
    """A task's command as the joblog and --dry-run show it: a shell line (``line``) as
    is, an argv as a shell would take it back, a call as ``MODULE:FUNC["arg", ...]``."""
    if call is not None:
        from slurm_fiber.protocol.framing import json_dumps

        return call + json_dumps(list(words))
    return words[-1] if line else shlex.join(words)


def lazily(lines: Iterator[str]) -> Iterator[Args]:
    """One task per line of a source read as it comes (a terminal's stdin)."""
    return ((line.rstrip("\n"),) for line in lines)
