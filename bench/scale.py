"""fiberd at scale: what N running fibers and G grants cost it (issue 19).

Two sweeps, each against a standalone ``fiberd`` of this checkout (a throwaway site
as bench/clone.py uses, its own flags only, default poll interval and grace 1 s):

  fibers  one grant; N fibers of ``sleep 600`` started through the socket without
          waiting, N rising through ``--fibers`` (0,1000,5000,10000) on the same
          fiberd. At each N: fiberd's idle CPU (its utime+stime from /proc/<pid>/stat
          over a ``--quiet`` window with no request), Clone p50/p99 (exec ``true``,
          waited, ``--clones`` samples), the time of one ``list_fibers`` request and
          fiberd's PSS (/proc/<pid>/smaps_rollup). It stops rising at the first N the
          machine refuses or that ``--budget`` seconds of starting cannot reach, and
          says why (the miss or error, fiberd's open fds against its limit, memory).
          Then fiberd is stopped (SIGTERM → exit, timed) with every fiber running,
          and, for the same N in the same hierarchies, the kernel's share of that stop
          is measured with no fiberd (bench/stop_bound.py: one cgroup.kill, reap,
          rmdir every leaf); ``stop_over_bound`` is fiberd's stop time over it.
  grants  for each G in ``--grants`` (1,10,100): a fresh fiberd with G grants (the
          quickstart's preloads), once every template is ready: idle CPU, Clone
          p50/p99 on the first grant, fiberd's PSS, the PSS of each grant's processes
          (template and spares) on average, the stop time, and the slowest ``status``
          round trip while the grants were admitted and warmed (``status_max_ms``).

After every stop it checks that nothing of the run is left: no process carrying the
run's mark, no cgroup named after the stopped fiberd (``slurm-fiber.<pid>``) under
/sys/fs/cgroup. Before the sweeps it measures the floor fiberd's PSS stands on, this
interpreter importing asyncio (with ssl and its libcrypto; bench/fiberd_pss.py),
and reports fiberd's PSS at N=0 over it (``fiberd_pss_over_floor``). The machine is
shared: read ratios, not absolute times. Run it as
root (or with a delegated cgroup) to carve cgroups, as fiberd runs in a job.
``--plot FILE`` draws cost against N and G (PNG; the ``plot`` extra). ``--quick``
is a smoke run small enough for a test. Ends with one JSON line.

    .venv/bin/python bench/scale.py [--fibers 0,1000,5000,10000] [--grants 1,10,100]
        [--clones 100] [--quiet 5] [--budget 600] [--plot scale.png] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fiberd_pss import floor_here  # bench/ is sys.path[0] for a script
from stop_bound import stop_bound  # bench/stop_bound.py

from slurm_fiber.cli.latency import MeasureFailed, clone_round_trips, percentiles
from slurm_fiber.cli.quickstart import DEFAULT_PRELOADS
from slurm_fiber.cli.throwaway import Site, SiteFailed
from slurm_fiber.client.connection import FiberdClient, Missed, Refused, Unreachable

CLK_TCK = os.sysconf("SC_CLK_TCK")
SLEEP_ARGV = ["sleep", "600"]
CGROUP_FS = Path("/sys/fs/cgroup")


class ScaleSite(Site):
    """A throwaway site with ``g0`` .. ``g<G-1>`` grants, run with fiberd's default
    grantdir poll interval (the quickstart polls every 0.1 s)."""

    @classmethod
    def with_grants(cls, root: Path, preloads: Sequence[str], grants: int) -> ScaleSite:
        site = cls.create(root, preloads, uids=[f"g{g}" for g in range(grants)])
        assert isinstance(site, ScaleSite)
        return site

    def flags(self, cgroup_root: str) -> list[str]:
        return [f for f in super().flags(cgroup_root) if not f.startswith("--poll-interval")]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_all_warm(self, grants: int, within: float) -> tuple[float, float]:
        """Block until every grant's template is ready: seconds it took, and the slowest
        ``status`` round trip meanwhile in ms (fiberd's loop stalled by admissions).
        Raises SiteFailed."""
        start, slowest = time.monotonic(), 0.0
        while True:
            asked = time.perf_counter()
            templates = self.request("status").get("templates")
            slowest = max(slowest, time.perf_counter() - asked)
            states = templates if isinstance(templates, dict) else {}
            ready = sum(1 for s in states.values() if s == "ready")
            if ready >= grants:
                return time.monotonic() - start, round(slowest * 1000, 1)
            if "warm_failed" in states.values():
                raise SiteFailed(f"a template failed to warm: {self.warm_error()}")
            if self.proc is not None and self.proc.poll() is not None:
                raise SiteFailed(f"fiberd exited while warming: {self.last_log_line()}")
            if time.monotonic() - start > within:
                raise SiteFailed(f"{ready}/{grants} templates ready after {within:g} s")
            time.sleep(0.2)


# ---------------------------------------------------------------- readings (/proc)


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (its own threads, not its children), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def idle_cpu(pid: int, window: float) -> float:
    """Percent of one core ``pid`` used over ``window`` seconds in which nobody asks it
    anything."""
    before, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    return round(100 * (cpu_seconds(pid) - before) / (time.monotonic() - t0), 2)


def pss_mb(pid: int) -> float:
    """Proportional set size of ``pid`` in MB (smaps_rollup), 0 when gone."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return round(int(line.split()[1]) / 1024, 2)
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/*/stat)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[1] == str(pid):
                out.append(int(entry))
    return out


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def why_stopped(site: ScaleSite, err: str) -> str:
    """The refusal ``err`` with what fiberd holds (fds vs its limit, PSS, processes)."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    alive = site.proc is not None and site.proc.poll() is None
    return (f"{err}; fiberd {'alive' if alive else 'dead'}, {open_fds(site.pid)} open fds "
            f"(RLIMIT_NOFILE {limit}), PSS {pss_mb(site.pid)} MB")


def carving_parents(pid: int) -> list[Path]:
    """The directories holding fiberd ``pid``'s ``slurm-fiber.<pid>`` trees, the cgroup2
    one first (where bench/stop_bound.py lays out its bound the same way)."""
    trees = [Path(t) for t in leftover_cgroups(pid) if os.path.basename(t) == f"slurm-fiber.{pid}"]
    return sorted((t.parent for t in trees), key=lambda p: not (p / "cgroup.controllers").exists())


def leftover_cgroups(pid: int) -> list[str]:
    """Directories named ``slurm-fiber.<pid>`` (and what is under them) left under
    /sys/fs/cgroup: the carving tree of a fiberd that has stopped."""
    name = f"slurm-fiber.{pid}"
    found = []
    for top, dirs, _ in os.walk(CGROUP_FS):
        if os.path.basename(top) == name:
            found += [top, *(str(Path(top, d)) for d in dirs)]
            dirs.clear()
    return found


# ---------------------------------------------------------------- measurements


@dataclass
class Stopped:
    seconds: float
    status: int | None
    left_running: list[int]
    left_cgroups: int
    left_cgroup_sample: list[str]


def stop(site: ScaleSite) -> Stopped:
    """SIGTERM fiberd, time until it has exited; what of the run is left."""
    pid = site.pid
    start = time.monotonic()
    status = site.stop(within=600)
    took = time.monotonic() - start
    left = leftover_cgroups(pid)
    return Stopped(round(took, 3), status, site.leftovers(), len(left), left[:3])


def start_fibers(site: ScaleSite, count: int, until: float) -> str | None:
    """Start ``count`` unwaited ``sleep`` fibers on grant g0; None, or why it stopped."""
    try:
        with FiberdClient(site.socket, timeout=60.0) as client:
            for _ in range(count):
                if time.monotonic() > until:
                    return "time budget (--budget) spent"
                client.clone(wait=False, grant="g0", exec={"argv": SLEEP_ARGV, "cwd": "/"})
    except (Missed, Refused, Unreachable) as err:
        return f"{type(err).__name__}: {err}"
    return None


def list_time(site: ScaleSite) -> tuple[float, int]:
    """Seconds of one ``list_fibers`` round trip and the records it returned."""
    with FiberdClient(site.socket, timeout=120.0) as client:
        start = time.perf_counter()
        result = client.request("list_fibers")
        took = time.perf_counter() - start
    fibers = result.get("fibers")
    return round(took * 1000, 2), len(fibers) if isinstance(fibers, list) else 0


def lost_fibers(site: ScaleSite) -> int:
    """Fibers whose exit the audit log records as ``lost`` (a sleep never ends by itself)."""
    lost = 0
    for line in site.audit_path.read_text().splitlines():
        record = json.loads(line)
        end = record.get("exit") if record.get("event") == "fiber_exit" else None
        lost += isinstance(end, dict) and end.get("state") == "lost"
    return lost


def clones(site: ScaleSite, n: int) -> dict[str, float]:
    return percentiles(clone_round_trips(site.socket, "exec", n, grant="g0", warmup=2))


def fiber_sweep(tmp: Path, ns: list[int], opts: argparse.Namespace) -> dict[str, object]:
    site = ScaleSite.with_grants(tmp / "fibers", ("json",), 1)
    points: list[dict[str, object]] = []
    stopped_at: str | None = None
    until = time.monotonic() + opts.budget
    running = 0
    site.start(opts.cgroup_root)
    try:
        site.wait_all_warm(1, 120)
        mode = site.request("status").get("mode")
        for n in ns:
            t0 = time.monotonic()
            err = start_fibers(site, n - running, until)
            if err is not None:
                stopped_at = f"below N={n}: {why_stopped(site, err)}"
                print(stopped_at, file=sys.stderr)
                break
            started_s = time.monotonic() - t0
            time.sleep(min(2.0, opts.quiet))  # spares refilled, the starts settled
            point: dict[str, object] = {"n": n, "start_s": round(started_s, 1),
                                        "idle_cpu_pct": idle_cpu(site.pid, opts.quiet)}
            point.update(clones(site, opts.clones))
            point["list_ms"], point["listed"] = list_time(site)
            point["fiberd_pss_mb"] = pss_mb(site.pid)
            point["fiberd_fds"] = open_fds(site.pid)
            point["running"] = site.request("status").get("fibers_running")
            point["lost"] = lost_fibers(site)
            running = int(point["running"] or 0)
            print(f"N={n}: {point}", file=sys.stderr)
            points.append(point)
            if point["lost"]:
                stopped_at = (f"at N={n}: {point['lost']} fibers ended as lost (killed by "
                              f"fiberd), {point['running']} running")
                print(stopped_at, file=sys.stderr)
                break
    finally:
        if site.proc is not None and site.proc.poll() is None:
            running = int(site.request("status").get("fibers_running") or 0)  # type: ignore[call-overload]
        parents = carving_parents(site.pid)
        end = stop(site)
    print(f"stop with {running} fibers: {end}", file=sys.stderr)
    return {"cgroups": mode, "points": points, "stopped_rising": stopped_at,
            "stop": {"fibers": running, **end.__dict__},
            "stop_bound": the_stop_bound(running, parents, end.seconds)}


def the_stop_bound(n: int, parents: list[Path], took: float) -> dict[str, object]:
    """bench/stop_bound.py for ``n`` processes in fiberd's hierarchies, with fiberd's stop
    time ``took`` as a ratio to it; why not, when it cannot run."""
    if not n or not parents or not (parents[0] / "cgroup.controllers").exists():
        return {"skipped": "no fibers at stop, or fiberd did not carve in cgroup v2"}
    try:
        bound = stop_bound(n, parents)
    except OSError as err:
        return {"skipped": f"cannot lay out the bound: {err}"}
    print(f"stop bound (kernel only, {len(parents)} hierarchies): {bound}; fiberd's stop "
          f"{took / bound['total_s']:.2f}x it", file=sys.stderr)
    return {**bound, "parents": [str(p) for p in parents],
            "stop_over_bound": round(took / bound["total_s"], 2)}


def grant_sweep(tmp: Path, gs: list[int], opts: argparse.Namespace) -> list[dict[str, object]]:
    points: list[dict[str, object]] = []
    for g in gs:
        site = ScaleSite.with_grants(tmp / f"grants-{g}", DEFAULT_PRELOADS, g)
        site.start(opts.cgroup_root)
        point = {"g": g}
        try:
            warm, stall = site.wait_all_warm(g, 60 + 3 * g)
            time.sleep(min(2.0, opts.quiet))
            point.update({"warm_s": round(warm, 1), "status_max_ms": stall,
                          "idle_cpu_pct": idle_cpu(site.pid, opts.quiet)})
            point.update(clones(site, opts.clones))
            templates = children(site.pid)
            per = [pss_mb(t) + sum(pss_mb(s) for s in children(t)) for t in templates]
            point["fiberd_pss_mb"] = pss_mb(site.pid)
            point["per_grant_pss_mb"] = round(sum(per) / len(per), 2) if per else None
            point["template_pss_mb"] = round(
                sum(pss_mb(t) for t in templates) / len(templates), 2) if templates else None
        except (SiteFailed, MeasureFailed) as err:
            point["failed"] = str(err)
        finally:
            end = stop(site)
        point["stop"] = end.__dict__
        print(f"G={g}: {point}", file=sys.stderr)
        points.append(point)
        if "failed" in point:
            break
    return points


def plot(figures: dict[str, object], path: Path) -> None:
    """Idle CPU, Clone p50 and stop time against N, and against G, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, points in ((axes[0], "n", figures["fibers"]["points"]),  # type: ignore[index]
                            (axes[1], "g", [p for p in figures["grants"]  # type: ignore[attr-defined]
                                            if "failed" not in p])):
        xs = [p[key] for p in points]
        ax.plot(xs, [p["idle_cpu_pct"] for p in points], "o-", label="idle CPU (% core)")
        ax.plot(xs, [p["p50_ms"] for p in points], "s-", label="Clone p50 (ms)")
        if key == "n":
            ax.plot(xs, [p["list_ms"] for p in points], "^-", label="list_fibers (ms)")
        else:
            ax.plot(xs, [p["per_grant_pss_mb"] for p in points], "^-", label="PSS per grant (MB)")
            ax.plot(xs, [p["stop"]["seconds"] for p in points], "v-", label="stop (s)")
        ax.plot(xs, [p["fiberd_pss_mb"] for p in points], "d-", label="fiberd PSS (MB)")
        ax.set_xlabel("running fibers N (1 grant)" if key == "n" else "grants G (no fibers)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("fiberd cost at scale, one run (shared machine: noisy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fibers", default="0,1000,5000,10000", help="N values, rising")
    parser.add_argument("--grants", default="1,10,100", help="G values ('' for none)")
    parser.add_argument("--clones", type=int, default=100, help="Clone samples per point")
    parser.add_argument("--quiet", type=float, default=5.0, help="idle CPU window (s)")
    parser.add_argument("--budget", type=float, default=900.0,
                        help="seconds the fiber starts may take in all")
    parser.add_argument("--cgroup-root", default="delegate", help="fiberd's cgroup root")
    parser.add_argument("--plot", type=Path, metavar="FILE", help="write the plot as a PNG")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: N 0,20; G 1,2; 5 clones; 0.5 s windows")
    opts = parser.parse_args()
    if opts.quick:
        opts.fibers, opts.grants, opts.clones, opts.quiet = "0,20", "1,2", 5, 0.5
    ns = sorted(int(x) for x in opts.fibers.split(",") if x)
    gs = sorted(int(x) for x in opts.grants.split(",") if x)
    floor = floor_here(sys.executable)["floor"]  # before any fiberd: nothing shared with one
    with tempfile.TemporaryDirectory(prefix="slurm-fiber-scale-") as tmp:
        try:
            fibers = fiber_sweep(Path(tmp), ns, opts)
            grants = grant_sweep(Path(tmp), gs, opts)
        except (SiteFailed, MeasureFailed) as err:
            print(json.dumps({"bench": "scale", "failed": str(err)}))
            return 1
    figures: dict[str, object] = {"bench": "scale", "fibers": fibers, "grants": grants,
                                  "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                                  "floor": floor}
    idle = [p for p in fibers["points"] if p["n"] == 0]  # type: ignore[attr-defined]
    if idle:
        figures["fiberd_pss_over_floor"] = round(idle[0]["fiberd_pss_mb"] / floor["pss_mb"], 3)
    if opts.plot:
        try:
            plot(figures, opts.plot)
            print(f"plot: {opts.plot}", file=sys.stderr)
        except ImportError as err:
            figures["plot"] = f"skipped: {err} (install the plot extra)"
    left = [fibers["stop"], *(p["stop"] for p in grants)]  # type: ignore[index]
    clean = all(not s["left_running"] and not s["left_cgroups"] for s in left)
    figures["clean_stops"] = clean
    print(json.dumps(figures))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
