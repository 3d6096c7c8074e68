"""``slurm-fiber quickstart`` end to end, run as a user runs it: a subprocess of the venv's script.

Checks the figures are sane, the audit log the run points to holds every
Clone it made, and nothing of the run is left: no process carrying its run
id, no fiberd on its state dir, no cgroup it carved, only the audit log kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.v1 import V1Layout

SLURM_FIBER = str(Path(sys.executable).parent / "slurm-fiber")
CLONES = 15
WARMUP = 3  # untimed clones per mode (slurm_fiber.cli.latency)


def environ() -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}


def quickstart(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SLURM_FIBER, "quickstart", *args], env=environ(),
                          capture_output=True, text=True, timeout=240)


def processes_mentioning(text: str) -> list[int]:
    """Live pids whose environment or command line contains ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            blob = Path(f"/proc/{pid}/environ").read_bytes() + Path(
                f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in blob and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def test_quickstart_json_runs_end_to_end_and_leaves_only_the_audit_log() -> None:
    out = quickstart("--json", "--clones", str(CLONES), "--cold-runs", "3")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    cold = figures["cold_start"]["p50_ms"]
    for mode in ("call", "exec"):
        clone = figures[f"clone_{mode}"]
        assert 0 < clone["p50_ms"] <= clone["p99_ms"] and clone["runs"] == CLONES
        assert clone["p50_ms"] < cold and clone["speedup_p50"] > 1
    assert figures["mode"] in {"carved", "uncarved"} and figures["cgroups"]["reason"]
    host = figures["enforcement"]
    backend = figures["cgroups"]["backend"]
    assert backend in {"none", "v2", "v1", "hybrid"}
    # This host's v1 devices hierarchy confines devices whenever fiberd carves v1 groups.
    v1_devices = backend in {"v1", "hybrid"} and "devices" in V1Layout.of_self().mounts
    assert host["devices"]["confined_by"] == ("cgroup v1 devices" if v1_devices else "env only")
    assert figures["cgroups"]["enforced"].startswith(backend if backend != "none" else "uncarved")
    assert set(host["unenforced"]) <= {"memory", "pids", "cpu"}
    assert host["limits"]["seconds"]["enforced_by"] == "fiberd"
    assert "warming" in out.stderr and "template 'quickstart' is warm" in out.stderr

    kept, audit = Path(figures["kept"]), Path(figures["audit_path"])
    assert list(kept.iterdir()) == [audit]
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    clones = [r for r in records if r["event"] == "clone"]
    assert len(clones) == 2 * (CLONES + WARMUP)
    assert {r["mode"] for r in clones} == {"call", "exec"}
    assert records[-1]["event"] == "stop" and records[-1]["reason"] == "stop requested"

    assert processes_mentioning(f"SLURM_FIBER_RUN={figures['run_id']}") == []
    assert processes_mentioning(str(kept)) == []
    root = figures["cgroups"]["root"]
    assert root is None or not Path(root).exists()
    if root is not None:  # nor its v1 groups
        layout = V1Layout.of_self()
        assert [c for c in layout.mounts if (r := layout.root(c, Path(root).name)) and r.exists()
                ] == []
    audit.unlink()
    kept.rmdir()


def test_a_template_that_cannot_warm_fails_in_one_line_and_stops_everything() -> None:
    out = quickstart("--preload", "json", "--preload", "no_such_module_for_quickstart",
                     "--clones", "1", "--cold-runs", "1")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("quickstart: failed: the template failed to warm")
    assert "no_such_module_for_quickstart" in last and "Traceback" not in out.stderr
    kept = Path(last.split("(kept ")[1].split(";")[0])
    assert (kept / "fiberd.log").exists()  # kept on failure, to be read
    assert processes_mentioning(str(kept)) == []
    subprocess.run(["rm", "-rf", str(kept)], check=True)


@pytest.mark.parametrize("args", [["--preload", "decimal"], ["--clones", "0"]])
def test_usage_errors_exit_2(args: list[str]) -> None:
    assert quickstart(*args).returncode == 2


def test_without_a_cgroup_root_it_runs_uncarved_and_says_so() -> None:
    out = quickstart("--cgroup-root", "none", "--clones", "2", "--cold-runs", "1")
    assert out.returncode == 0, out.stderr
    assert "cgroups: uncarved (" in out.stdout and "nothing of this run is left" in out.stdout
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("cgroups: uncarved (")]
    assert line.endswith("; limits NOT enforced here: memory, pids, cpu; devices: env only")
    audit = Path(out.stdout.split("audit log: ")[1].split("\n")[0])
    subprocess.run(["rm", "-rf", str(audit.parent)], check=True)
