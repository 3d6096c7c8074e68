"""What putting a fiber in its own cgroup costs, and what CLONE_INTO_CGROUP would save.

A fiber today is forked and then writes itself into its cgroup
(``cgroup.procs``). A cgroup v2 migration takes the cgroup threadgroup
rwsem for writing, which waits for an RCU grace period unless another
migration happened moments before (the kernel's rcu_sync stays "hot" only
briefly; mounting cgroup2 with ``favordynmods`` avoids the wait). So the
cost depends on how far apart Clones are: back-to-back it is small, one
every 50 ms pays a full grace period. ``clone3(CLONE_INTO_CGROUP)`` creates
the child inside the target cgroup with no migration at all.

For each gap between samples (0 and 50 ms) it times fork → exit → wait three
ways from this process: plain fork (the floor), fork then join a fresh leaf
cgroup, and clone3 into a fresh leaf (via ctypes: ``PyOS_BeforeFork`` /
``PyOS_AfterFork_*`` around the raw syscall, as ``os.fork`` does; the child
checks it landed in its leaf). Needs a writable cgroup v2 hierarchy (root, or
a delegated subtree); otherwise it says why in its JSON line and exits 1.
Leaves no cgroup behind. Ends with one JSON line.

    .venv/bin/python bench/cgroup_join.py [-n 40]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import struct
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from slurm_fiber.homes.cgroupdelegate import own_cgroup, unified_mount

SYS_CLONE3 = 435  # x86_64 and aarch64
CLONE_INTO_CGROUP = 0x200000000
GAPS = (0.0, 0.05)

_libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held, as in os.fork
_libc.syscall.restype = ctypes.c_long


def clone_into(cgroup_fd: int) -> int:
    """fork(), but the child starts inside the cgroup ``cgroup_fd`` names. OSError on failure."""
    args = struct.pack("=11Q", CLONE_INTO_CGROUP, 0, 0, 0, 17, 0, 0, 0, 0, 0, cgroup_fd)
    buf = ctypes.create_string_buffer(args, len(args))
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = _libc.syscall(SYS_CLONE3, buf, ctypes.c_size_t(len(args)))
    if pid == 0:
        ctypes.pythonapi.PyOS_AfterFork_Child()
        return 0
    ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"clone3: {os.strerror(err)}")
    return pid


def own_dir() -> Path:
    """This process's cgroup v2 directory. OSError when there is none."""
    mount = unified_mount(Path("/proc/self/mountinfo").read_text())
    cgroup = own_cgroup(Path("/proc/self/cgroup").read_text())
    if mount is None or cgroup is None:
        raise OSError("no cgroup v2 hierarchy for this process")
    relative = os.path.relpath(cgroup, mount[1])
    return Path(mount[0]) / ("" if relative == "." else relative)


@contextmanager
def bench_tree() -> Iterator[Path]:
    """A scratch subtree of this process's cgroup, this process moved into a leaf of it;
    on exit the process moves back and the subtree is removed."""
    here = own_dir()
    root = here / f"sf-bench-{os.getpid()}"
    root.mkdir()
    try:
        (root / "self").mkdir()
        (root / "self" / "cgroup.procs").write_text("0\n")
        try:
            yield root
        finally:
            (here / "cgroup.procs").write_text("0\n")
    finally:
        for leaf in sorted(root.iterdir(), reverse=True) if root.exists() else []:
            if leaf.is_dir():
                leaf.rmdir()
        root.rmdir()


def plain(_leaf: Path) -> int:
    return os.fork()


def fork_then_join(leaf: Path) -> int:
    pid = os.fork()
    if pid == 0:
        fd = os.open(leaf / "cgroup.procs", os.O_WRONLY)
        os.write(fd, b"0\n")
    return pid


def clone3_into(leaf: Path) -> int:
    fd = os.open(leaf, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return clone_into(fd)
    finally:
        os.close(fd)  # in the child too: it only checks its cgroup and exits


def sample(root: Path, start: Callable[[Path], int], name: str, n: int, gap: float) -> list[float]:
    """Seconds per start → child checks its cgroup and exits → waitpid, ``gap`` apart."""
    out = []
    for i in range(n):
        leaf = root / f"{name}-{i}"
        leaf.mkdir()
        time.sleep(gap)
        t = time.perf_counter()
        pid = start(leaf)
        if pid == 0:
            placed = Path("/proc/self/cgroup").read_text().strip().endswith(leaf.name)
            os._exit(0 if placed or start is plain else 3)
        _, status = os.waitpid(pid, 0)
        out.append(time.perf_counter() - t)
        leaf.rmdir()
        if os.waitstatus_to_exitcode(status) != 0:
            raise OSError(f"{name}: the child was not in its cgroup")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=40, help="samples per way and gap")
    opts = parser.parse_args()
    figures: dict[str, object] = {"bench": "cgroup_join"}
    ways = {"fork": plain, "fork_join": fork_then_join, "clone3_into": clone3_into}
    try:
        with bench_tree() as root:
            for gap in GAPS:
                row = {}
                for name, start in ways.items():
                    samples = sample(root, start, name, opts.n, gap)
                    row[f"{name}_p50_ms"] = round(statistics.median(samples) * 1000, 3)
                figures[f"gap_{int(gap * 1000)}ms"] = row
                print(f"gap {gap * 1000:4.0f} ms: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in row.items()), file=sys.stderr)
    except OSError as err:
        figures["unavailable"] = str(err)
        print(json.dumps(figures))
        return 1
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
