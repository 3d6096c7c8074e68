"""What an Executor call prints is not lost (issue 39, 5): each future gives its fiber's
captured stdout and stderr (as submitit's ``job.stdout()``), and by default the caller
sees it on its own stdout and stderr, each call's whole, as a ProcessPoolExecutor
worker's prints would show. Against the module's real standalone fiberd."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from slurm_fiber import Executor
from slurm_fiber.cli.throwaway import Site
from tests.executor import fnkit


def test_a_future_gives_what_its_call_printed(site: Site) -> None:
    with Executor(socket=site.socket, max_workers=2, echo=False) as ex:
        good, bad = ex.submit(fnkit.echo_and_fail, "good"), ex.submit(fnkit.echo_and_fail, "bad")
        assert good.result(timeout=60) == "good"
        assert good.stdout() == "printed good\n" and good.stderr() == ""
        assert isinstance(bad.exception(timeout=60), ValueError)
        assert bad.stdout() == "printed bad\n"
        by_value = ex.submit(lambda: print("to stderr", file=sys.stderr) or 7)
        assert by_value.result(timeout=60) == 7 and by_value.stderr() == "to stderr\n"


def test_the_caller_sees_each_calls_output_by_default(site: Site) -> None:
    code = ("from slurm_fiber import Executor\nfrom tests.executor import fnkit\n"
            "with Executor(max_workers=2) as ex:\n"
            "    print(sorted(ex.map(fnkit.echo_and_fail, ['x', 'y'])))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parents[2],
                         env={"PATH": os.environ["PATH"], "FIBERD_SOCKET": str(site.socket)})
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["['x', 'y']", "printed x", "printed y"]
