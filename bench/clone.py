"""Clone latency against its baselines, all in one run, with the same preloads (issue 3).

Four paths, measured in interleaved rounds so a busy moment of the shared
machine falls on all of them alike:

  (a) cold start: ``python -c "import <preloads>"`` with the venv's own interpreter;
  (b) the floor: raw fork → child ``os._exit(0)`` → ``waitpid`` from an interpreter
      holding the preloads, heap frozen (bench/fork_floor.py);
  (c) ``multiprocessing`` forkserver ``Process`` start + join, the preloads given
      as an explicit list (``set_forkserver_preload``), target a no-op builtin, from
      a ``python -c`` program (from a script, each child would re-import it);
  (e) the bound: the least a Python Clone could cost here, measured, not
      assumed (bench/fork_floor.py ``spare_pipeline``): one blocking process is
      daemon and template, hands a request to a pre-forked spare, reaps it and
      replies; no admission, audit, cgroup, confinement or separate template.
      Its ratio to the floor says how much of the target the machine leaves;
      the Clone's ratio to it, how much fiberd's own work costs;
  (d) a Clone round trip through a real fiberd's socket (standalone home, the
      quickstart's throwaway site, one grant whose template holds the preloads):
      request → fiber forked, run, reaped → exit event received, one client
      connection; call mode (``json:dumps``) and exec mode (``true``); and, for
      information (no target), call mode paced: one Clone every ``--pace-ms``
      (n/5 samples), as a caller that is not hammering fiberd sees it. Paced,
      any cgroup move on a Clone's path would cost an RCU grace period; the
      template's spare (fiberd ``--spares``) keeps it off;
  (f) for exec mode's baseline: ``subprocess.run(["true"])`` from this process;
  (g) the CPU a Clone costs, per mode and per process: fiberd itself, its template,
      the fibers (each spare from its fork to its exit, or spawned program, and what
      it exec'd), the helpers alive under the template (idle spares) and this client,
      over the samples, per Clone. Their sum over the CPUs is what bounds throughput;
      ``total`` is exec mode's old single figure.

Targets: Clone p50 ≤ 1.5x the floor's p50, and ≥ 20x faster than (a) when
(a) takes ≥ 200 ms. The report says for each mode whether they were met.
``--plot FILE`` draws the latency CDFs as a PNG (needs the ``plot`` extra).
Ends with one JSON line of figures. Leaves nothing running (checked).

    .venv/bin/python bench/clone.py [-n 300] [--cold-runs 15] [--pace-ms 50] [--plot cdf.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import plots  # bench/plots.py
from fork_floor import fork_floor, forkserver_start, spare_pipeline

from slurm_fiber.cli.latency import (
    MODES,
    clone_round_trips,
    cold_start,
    import_line,
    percentiles,
    ratio,
)
from slurm_fiber.cli.quickstart import DEFAULT_PRELOADS
from slurm_fiber.cli.throwaway import GRANT, Site
from slurm_fiber.core.cgroups.manager import BACKEND_CHOICES

FLOOR_FACTOR = 1.5  # Clone p50 at most this many times the floor's p50
COLD_FACTOR = 20.0  # Clone p50 at least this many times faster than the cold start
COLD_MIN_MS = 200.0  # ... for a cold import at least this slow


def split(total: int, rounds: int) -> list[int]:
    """``total`` samples spread over ``rounds`` (at least one per round)."""
    return [max(1, total // rounds + (i < total % rounds)) for i in range(rounds)]


def spawn_true(n: int) -> list[float]:
    """Wall seconds of ``subprocess.run(["true"])``, n times: exec mode's plain baseline."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        subprocess.run(["true"], check=True)
        out.append(time.perf_counter() - start)
    return out


ROLES = ("fiberd", "template", "fibers", "helpers", "client")


def _times(pid: int) -> tuple[float, float]:
    """CPU seconds of ``pid`` itself and of the children it reaped (0, 0 when gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    ticks = [int(f) for f in fields[11:15]]  # utime stime cutime cstime
    return (ticks[0] + ticks[1]) / tick, (ticks[2] + ticks[3]) / tick


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    except OSError:
        return []  # gone meanwhile


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds so far of fiberd ``pid`` and what runs under it, by role (``ROLES``):
    fiberd itself, its templates, the fibers they reaped, their live children (spares,
    with what those reaped) and this process."""
    out = dict.fromkeys(ROLES, 0.0)
    out["fiberd"] = _times(pid)[0]
    for template in _children(pid):
        out["template"], out["fibers"] = map(sum, zip((out["template"], out["fibers"]),
                                                      _times(template), strict=True))
        out["helpers"] += sum(sum(_times(c)) for c in _children(template))
    me = os.times()
    out["client"] = me.user + me.system
    return out


def measure(site: Site, n: int, cold_runs: int, rounds: int,
            pace: float) -> dict[str, list[float]]:
    """Samples (seconds) of every path, taken in interleaved rounds; ``cpu_<mode>_<role>``
    hold one figure per round: CPU seconds per Clone of that mode in that role."""
    samples: dict[str, list[float]] = {k: [] for k in ("cold_start", "fork_floor",
                                                       "forkserver", "pipeline", "clone_call",
                                                       "clone_exec", "clone_call_paced",
                                                       "spawn_true")}
    samples.update({f"cpu_{mode}_{role}": [] for mode in MODES for role in ROLES})
    assert site.proc is not None
    for k, (cold_n, n_i) in enumerate(zip(split(cold_runs, rounds), split(n, rounds),
                                          strict=True)):
        print(f"round {k + 1}/{rounds}: {cold_n} cold starts, {n_i} samples of each other path",
              file=sys.stderr)
        samples["cold_start"] += cold_start(site.preloads, cold_n)
        samples["fork_floor"] += fork_floor(list(site.preloads), n_i)
        samples["forkserver"] += forkserver_start(list(site.preloads), n_i)
        samples["pipeline"] += spare_pipeline(list(site.preloads), n_i)
        samples["spawn_true"] += spawn_true(n_i)
        for mode in MODES:
            warmup = 3 if k == 0 else 0
            before = cpu_by_role(site.proc.pid)
            samples[f"clone_{mode}"] += clone_round_trips(site.socket, mode, n_i, grant=GRANT,
                                                          warmup=warmup)
            after = cpu_by_role(site.proc.pid)
            for role in ROLES:
                samples[f"cpu_{mode}_{role}"].append((after[role] - before[role])
                                                     / (n_i + warmup))
        samples["clone_call_paced"] += clone_round_trips(site.socket, "call", max(1, n_i // 5),
                                                         grant=GRANT, warmup=0, pause=pace)
    return samples


def report(samples: dict[str, list[float]]) -> dict[str, object]:
    """The figures: percentiles per path, ratios vs the floor and the cold start, targets."""
    figures: dict[str, object] = {k: {**percentiles(v), "n": len(v)} for k, v in samples.items()
                                  if not k.startswith("cpu_")}
    floor = statistics.median(samples["fork_floor"])
    cold = statistics.median(samples["cold_start"])
    targets: dict[str, object] = {}
    for mode in MODES:
        clone = statistics.median(samples[f"clone_{mode}"])
        over_floor, speedup = ratio(clone, floor), ratio(cold, clone)
        targets[mode] = {
            "p50_over_floor": over_floor, "floor_target_met": over_floor <= FLOOR_FACTOR,
            "faster_than_cold": speedup, "cold_target_met": speedup >= COLD_FACTOR,
        }
    targets["forkserver_over_floor"] = ratio(statistics.median(samples["forkserver"]), floor)
    bound = statistics.median(samples["pipeline"])
    targets["pipeline_over_floor"] = ratio(bound, floor)
    targets["clone_call_over_pipeline"] = ratio(statistics.median(samples["clone_call"]), bound)
    targets["cold_over_floor"] = ratio(cold, floor)
    targets["cold_start_is_slow_enough"] = cold * 1000 >= COLD_MIN_MS
    targets["clone_exec_over_spawn_true"] = ratio(statistics.median(samples["clone_exec"]),
                                                  statistics.median(samples["spawn_true"]))
    cpu = {mode: {role: round(statistics.median(samples[f"cpu_{mode}_{role}"]) * 1000, 2)
                  for role in ROLES} for mode in MODES}
    for per_role in cpu.values():
        per_role["total"] = round(sum(per_role.values()), 2)
    targets["cpu_per_clone_ms"] = cpu
    targets["exec_clone_cpu_ms"] = cpu["exec"]["total"]
    figures["targets"] = targets
    return figures


def print_table(figures: dict[str, object]) -> None:
    names = {"cold_start": "(a) cold start", "fork_floor": "(b) raw fork floor",
             "forkserver": "(c) mp forkserver Process",
             "pipeline": "(e) bound: minimal pipeline", "clone_call": "(d) Clone, call mode",
             "clone_exec": "(d) Clone, exec mode",
             "clone_call_paced": "(d) Clone, call mode, paced",
             "spawn_true": "(f) subprocess.run(true)"}
    floor = figures["fork_floor"]["p50_ms"]  # type: ignore[index]
    cold = figures["cold_start"]["p50_ms"]  # type: ignore[index]
    print(f"{'path':30}{'p50 ms':>10}{'p99 ms':>10}{'x floor':>10}{'cold /':>10}")
    for key, name in names.items():
        f = figures[key]
        p50 = f["p50_ms"]  # type: ignore[index]
        print(f"{name:30}{p50:>10.2f}{f['p99_ms']:>10.2f}"  # type: ignore[index]
              f"{ratio(p50, floor):>10.1f}{ratio(cold, p50):>10.1f}")
    targets = figures["targets"]
    for mode in MODES:
        t = targets[mode]  # type: ignore[index]
        print(f"Clone {mode}: p50 = {t['p50_over_floor']}x the floor "
              f"({'meets' if t['floor_target_met'] else 'MISSES'} <= {FLOOR_FACTOR}x); "
              f"{t['faster_than_cold']}x faster than cold "
              f"({'meets' if t['cold_target_met'] else 'MISSES'} >= {COLD_FACTOR:g}x)")
    print(f"Clone exec (true): p50 = {targets['clone_exec_over_spawn_true']}x "  # type: ignore[index]
          "subprocess.run(true)'s")
    for mode, per_role in targets["cpu_per_clone_ms"].items():  # type: ignore[index]
        print(f"CPU per {mode} Clone, ms: " + ", ".join(f"{role} {ms}"
                                                       for role, ms in per_role.items()))
    if not targets["cold_start_is_slow_enough"]:  # type: ignore[index]
        print(f"note: the cold start took under {COLD_MIN_MS:g} ms here; add preloads")


def plot(samples: dict[str, list[float]], path: Path) -> None:
    """Latency CDFs of every path, log time axis, as a PNG at ``path``."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    latencies = {k: v for k, v in samples.items() if not k.startswith("cpu_")}  # not CPU
    plots.latency_cdfs(ax, latencies, xlabel="latency (ms, log scale)",
                       ylabel="fraction of starts",
                       title="start latency CDF, same preloads, one run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=300, help="samples per path but (a)")
    parser.add_argument("--cold-runs", type=int, default=15, help="samples of (a)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--preload", action="append", metavar="MODULE",
                        help="a module to preload (repeatable; default: the quickstart's)")
    parser.add_argument("--cgroup-root", default="delegate", help="fiberd's cgroup root")
    parser.add_argument("--cgroup-backend", default="auto", choices=BACKEND_CHOICES,
                        help="fiberd's cgroup backend (v2 vs hybrid: what v1 placement costs)")
    parser.add_argument("--pace-ms", type=float, default=50.0,
                        help="pause after each paced Clone (default 50)")
    parser.add_argument("--plot", type=Path, metavar="FILE", help="write the CDFs as a PNG")
    opts = parser.parse_args()
    preloads = tuple(opts.preload or DEFAULT_PRELOADS)
    rounds = max(1, min(opts.rounds, opts.n, opts.cold_runs))
    print(f"preloads: {import_line(preloads)}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="slurm-fiber-bench-") as tmp:
        site = Site.create(Path(tmp), preloads)
        try:
            site.backend = opts.cgroup_backend
            site.start(opts.cgroup_root)
            site.wait_warm(120, lambda state, s: None)
            status = site.request("status")
            mode = status.get("mode")
            cgroups = status.get("cgroups")
            backend = cgroups.get("backend") if isinstance(cgroups, dict) else None
            samples = measure(site, opts.n, opts.cold_runs, rounds, opts.pace_ms / 1000)
        finally:
            site.stop()
        left = site.leftovers()
    figures = {"bench": "clone", "preloads": list(preloads), "cgroups": mode,
               "cgroup_backend": backend, **report(samples),
               "left_running": left}
    print_table(figures)
    if opts.plot:
        plot(samples, opts.plot)
        print(f"CDF plot: {opts.plot}")
    print(json.dumps(figures))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
