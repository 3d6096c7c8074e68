"""fiberd's memory budget, declared in slurm_fiber/core/runtime/memory.py: a standalone
fiberd with one warm grant stays within ``PSS_BUDGET_MB`` of proportional set size (the
bench measures it beside the interpreter's floor; its --slurm mode needs a cluster: run it
by hand, see bench/fiberd_pss.py), and has loaded none of the modules ``KEPT_OUT`` names."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slurm_fiber.core.runtime.memory import KEPT_OUT, PSS_BUDGET_MB
from tests.cli.commandkit import env, flags, wait_ready, wait_socket
from tests.core.runtime.fiberdkit import Site

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fiberd_pss.py"


def test_fiberd_stays_within_its_pss_budget_beside_the_floor() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--samples", "1", "--settle", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["where"] == "standalone"
    floor = figures["samples"][0]["floor"]
    assert (0 < floor["bare"]["pss_mb"] < floor["floor"]["pss_mb"]
            < floor["floor_with_ssl"]["pss_mb"])
    fiberd = figures["samples"][0]["fiberd"]
    assert fiberd["pss_mb"] > 0 and fiberd["uss_mb"] > 0
    [budget] = figures["summary"]["budget_pss_mb"]
    assert budget == PSS_BUDGET_MB
    assert fiberd["pss_mb"] <= budget, f"fiberd's PSS {fiberd['pss_mb']} MB > {budget} MB"
    summary = figures["summary"]
    assert 0 < summary["pss_over_floor_with_ssl"][0] < summary["pss_over_floor"][0]


# fiberd through its console script's entry point; on SIGUSR1 it writes which of the kept-out
# modules it has loaded to the file $SF_TEST_LOADED.
FIBERD_TELLING = """\
import os, signal, sys
from slurm_fiber.core.runtime.memory import kept_out_loaded
def tell(*_):
    with open(os.environ["SF_TEST_LOADED"] + ".tmp", "w") as f:
        f.write(" ".join(kept_out_loaded(sys.modules)))
    os.rename(os.environ["SF_TEST_LOADED"] + ".tmp", os.environ["SF_TEST_LOADED"])
signal.signal(signal.SIGUSR1, tell)
sys.argv[0] = "fiberd"
from slurm_fiber.cli.fiberd import main
main()
"""


def test_a_fiberd_with_a_warm_grant_loads_nothing_memory_keeps_out(site: Site,
                                                                    tmp_path: Path) -> None:
    site.drop()
    told = tmp_path / "loaded"
    proc = subprocess.Popen([sys.executable, "-c", FIBERD_TELLING, *flags(site)],
                            env=env() | {"SF_TEST_LOADED": str(told)}, text=True,
                            start_new_session=True)
    try:
        wait_ready(wait_socket(site, proc))  # the grant verified, its template warm
        os.kill(proc.pid, signal.SIGUSR1)
        end = time.monotonic() + 20
        while not told.exists():
            assert proc.poll() is None and time.monotonic() < end, "fiberd did not tell"
            time.sleep(0.05)
        assert {"typer", "prometheus_client", "psutil"} <= set(KEPT_OUT)
        assert told.read_text().split() == []
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
