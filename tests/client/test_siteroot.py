"""The site file's state_root as a client reads it: from its plain line, or with tomllib."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_fiber.client.siteroot import plain_line, plain_state_root, site_state_root

CHECKOUT = Path(__file__).resolve().parents[2]
SHIPPED = [CHECKOUT / "contrib" / "slurm.conf.d" / "slurm-fiber.toml",
           CHECKOUT / "docker" / "slurm-cluster" / "slurm-fiber.toml"]

# Valid TOML a plain line says state_root in: found without tomllib, as tomllib reads it.
PLAIN = [
    'state_root = "/srv/sf"\n',
    'state_root="/srv/sf"',
    '# a comment\n\nissuer = "c"\n\tstate_root \t=\t "/srv/sf"   # where job state lives\n',
    'state_root = "relative/dir"\r\nissuer = "c"\r\n',
    'state_root = "/srv/ünï cödé"\n[trust]\nc = "/k"\n',
    'issuer = "c"\nfatal = ["config"]\nstate_root = "/a"\n[grant]\nstate_root = "/b"\n',
    'state_root = ""\n',  # empty: found; the caller refuses it
]
# Valid TOML where the line is not plain, or could mean something else: left to tomllib.
NOT_PLAIN = [
    '"state_root" = "/srv/sf"\n',
    "state_root = '/srv/sf'\n",
    'state_root = "/srv/s\\u0066"\n',
    'state_root = "/srv/\tsf"\n',
    '[site]\nstate_root = "/srv/sf"\n',
    'motd = """\nstate_root = "/fake"\n"""\nstate_root = "/real"\n',
    "motd = '''\nstate_root = \"/fake\"\n'''\nstate_root = \"/real\"\n",
    'm = [\n  [1, 2],\n]\nstate_root = "/srv/sf"\n',
    'issuer = "c"\n',
    "",
]


@pytest.mark.parametrize("text", PLAIN + [path.read_text() for path in SHIPPED])
def test_a_plain_line_gives_what_tomllib_reads(text: str) -> None:
    assert plain_state_root(text) == tomllib.loads(text)["state_root"]


@pytest.mark.parametrize("text", NOT_PLAIN)
def test_anything_else_is_left_to_tomllib(text: str, tmp_path: Path) -> None:
    assert plain_state_root(text) is None
    site = tmp_path / "site.toml"
    site.write_text(text)
    expected = tomllib.loads(text).get("state_root") or "/var/lib/slurm-fiber"
    assert site_state_root({"SLURM_FIBER_CONFIG": str(site)}) == expected  # all absolute


def test_a_file_that_is_not_toml_gives_its_plain_line_or_the_default(tmp_path: Path) -> None:
    site = tmp_path / "site.toml"
    environ = {"SLURM_FIBER_CONFIG": str(site)}
    site.write_text('state_root = "/srv/sf"\nfatal = [\n')  # fiberd-run refuses the file
    assert site_state_root(environ) == "/srv/sf"
    site.write_bytes(b'state_root = "/srv/\xff"\n')  # not UTF-8: nothing read
    assert site_state_root(environ) == "/var/lib/slurm-fiber"


# The plain line as a regular expression: the reading plain_line does by hand (so that
# fiberctl in a job imports no re), checked against it on generated lines.
PLAIN_LINE = re.compile(
    r'state_root[ \t]*=[ \t]*"([^"\\\x00-\x1f\x7f]*)"[ \t]*(?:#[^\x00-\x08\x0a-\x1f\x7f]*)?')
CHARS = ["a", "/", " ", "\t", '"', "'", "\\", "#", "=", "\x00", "\x01", "\x08", "\x0a", "\x0b",
         "\x1f", "\x7f", "\x80", "é"]
PART = st.lists(st.sampled_from(CHARS), max_size=4).map("".join)
BLANKS = st.sampled_from(["", " ", "\t", " \t "])


# Mostly the plain line's own shape, so that what breaks it is one piece at a time.
LINES = st.tuples(
    st.sampled_from(["state_root"] * 6 + ["state_roo", "state_rootx", "'state_root'"]),
    BLANKS, st.sampled_from(["="] * 6 + ["", "=="]), BLANKS,
    st.sampled_from(['"'] * 6 + ["'", ""]), PART, st.sampled_from(['"'] * 6 + ["'", ""]),
    BLANKS, st.sampled_from(["", "#", "#", "x"]), PART,
).map("".join)


@settings(max_examples=3000, deadline=None)
@given(LINES)
def test_a_plain_line_is_read_as_the_expression_says(line: str) -> None:
    found = PLAIN_LINE.fullmatch(line)
    assert plain_line(line) == (found.group(1) if found else None)


@pytest.mark.parametrize("line", [
    'state_root = "/srv/sf"', 'state_root="/a" # c\tc', 'state_root\t=\t""',
    'state_root = "/a"x', 'state_root = "/a', 'state_root = "/a" #\x01', "state_root = '/a'",
    'state_root = "/a\\b"', 'state_roots = "/a"', 'state_root = "/a\x7f"', '= "/a"',
    'state_root = "/a\tb"', 'state_root = "/a" #\tc\n'])
def test_lines_the_expression_takes_or_refuses(line: str) -> None:
    found = PLAIN_LINE.fullmatch(line)
    assert plain_line(line) == (found.group(1) if found else None)
