"""A daemon command's start-up gives asyncio no ``ssl`` for the homes that never speak TLS
(slurm, standalone) and leaves it to the others (kubernetes); ``import ssl`` always works."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli.commandkit import fiberd, wait_ready, wait_socket
from tests.core.runtime.fiberdkit import Site

# Both daemon commands' modules, the first step they take for a home, then the daemon and
# the built-in homes' modules; what asyncio and the process hold; last, ssl still imports.
EARLY = """\
import json, sys
import slurm_fiber.cli.fiberd_run
from slurm_fiber.cli.fiberd import configured
from slurm_fiber.cli.notls import asyncio_for_home
home, how = sys.argv[1:]
if how == "configured":
    configured({"config": None, "home": home})
else:
    asyncio_for_home(home)
import asyncio.sslproto, slurm_fiber.daemon, slurm_fiber.homes.slurm.home
import slurm_fiber.homes.standalone, slurm_fiber.core.trust.issuers
seen = {"ssl_loaded": "ssl" in sys.modules, "asyncio_tls": asyncio.sslproto.ssl is not None}
import ssl
ssl.create_default_context()
print(json.dumps(seen))
"""


def early(home: str, how: str) -> dict[str, bool]:
    out = subprocess.run([sys.executable, "-c", EARLY, home, how], capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize(("home", "how"), [
    ("standalone", "configured"), ("slurm", "asyncio_for_home")])
def test_homes_without_tls_never_load_ssl(home: str, how: str) -> None:
    assert early(home, how) == {"ssl_loaded": False, "asyncio_tls": False}


@pytest.mark.parametrize(("home", "how"), [
    ("kubernetes", "configured"), ("no-such-home", "asyncio_for_home")])
def test_other_homes_keep_asyncio_tls(home: str, how: str) -> None:
    assert early(home, how) == {"ssl_loaded": True, "asyncio_tls": True}


def test_a_standalone_fiberd_verifies_grants_without_libssl(site: Site) -> None:
    site.drop()
    with fiberd(site) as proc:
        wait_ready(wait_socket(site, proc))  # the grant's signature checked: core/trust.py
        with open(f"/proc/{proc.pid}/maps") as maps:
            mapped = {line.split()[-1].rsplit("/", 1)[-1] for line in maps if "/lib" in line}
    assert any(name.startswith("libcrypto.so") for name in mapped)
    assert not any(name.startswith("libssl.so") for name in mapped)
