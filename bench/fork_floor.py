"""Baselines for bench/clone.py: cold start, raw fork floor and a Clone bound, same preloads.

``cold_start(preloads, n)`` (from ``slurm_fiber.cli.latency``, shared with the
quickstart): wall seconds of ``sys.executable -c "import <preloads>"`` (the
venv's own interpreter, never a PATH shim). ``fork_floor(preloads, n)``:
in a child interpreter that has imported the preloads and frozen its heap,
the wall seconds of fork → child ``os._exit(0)`` → ``waitpid``.
``forkserver_start(preloads, n)``: multiprocessing's forkserver Process
start + join with the preloads given explicitly. ``spare_pipeline(preloads,
n)``: the least a Python Clone could cost here, a bound, not a product: one
blocking server process holding the preloads is daemon and template at once,
keeps one pre-forked spare, and per request hands it the order, reads its
result, reaps it, replies, then forks the next spare; no admission, audit,
cgroup or confinement. All block;
run them from a script, not from fiberd. ``python bench/fork_floor.py
[-n N] MODULE...`` prints one JSON line with the p50/p99 of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from slurm_fiber.cli.latency import cold_start, percentiles

_FLOOR = """
import gc, json, os, sys, time
for m in sys.argv[2:]:
    __import__(m)
gc.collect(); gc.freeze()
out = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""


_FORKSERVER = """
import json, multiprocessing, os, sys, time
ctx = multiprocessing.get_context("forkserver")
ctx.set_forkserver_preload(sys.argv[2:])
out = []
for i in range(int(sys.argv[1]) + 1):  # the first start launches the server: not counted
    p = ctx.Process(target=os.getpid)  # a builtin: pickled by name, nothing to import
    t = time.perf_counter()
    p.start()
    p.join()
    if p.exitcode != 0:
        sys.exit(f"a forkserver Process exited with {p.exitcode}")
    out.append(time.perf_counter() - t)
print(json.dumps(out[1:]))
"""


_PIPELINE = """
import gc, json, os, socket, sys, time
for m in sys.argv[2:]:
    __import__(m)
gc.collect(); gc.freeze()

def spare():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        data = theirs.recv(65536)
        if data:
            order = json.loads(data)
            module, _, name = order["target"].partition(":")
            value = getattr(sys.modules[module], name)(*order["args"])
            theirs.send(json.dumps({"ok": True, "result": value}).encode())
        os._exit(0)
    theirs.close()
    return pid, ours

def serve(conn):
    pid, channel = spare()
    while True:
        request = conn.recv(65536)
        if not request:
            channel.close()
            os.waitpid(pid, 0)
            return
        channel.send(request)
        reply = channel.recv(65536)
        os.waitpid(pid, 0)
        channel.close()
        conn.send(reply)
        pid, channel = spare()

client, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
server_pid = os.fork()
if server_pid == 0:
    client.close()
    serve(server)
    os._exit(0)
server.close()
request = json.dumps({"target": "json:dumps", "args": [[1, 2, 3]]}).encode()
out = []
for _ in range(int(sys.argv[1]) + 3):  # three untimed warm-up requests
    t = time.perf_counter()
    client.send(request)
    if json.loads(client.recv(65536)) != {"ok": True, "result": "[1, 2, 3]"}:
        sys.exit("the pipeline's spare returned a wrong result")
    out.append(time.perf_counter() - t)
client.close()
os.waitpid(server_pid, 0)
print(json.dumps(out[3:]))
"""


def _samples(program: str, preloads: list[str], n: int) -> list[float]:
    """Run ``program`` in a fresh ``python -c`` (no __main__ file for children to re-import)
    with argv ``n preloads...``; the JSON list of seconds it prints."""
    done = subprocess.run([sys.executable, "-c", program, str(n), *preloads], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout)


def fork_floor(preloads: list[str], n: int) -> list[float]:
    """Seconds per raw fork+exit+wait from a process holding ``preloads``, n runs."""
    return _samples(_FLOOR, preloads, n)


def forkserver_start(preloads: list[str], n: int) -> list[float]:
    """Seconds per multiprocessing forkserver Process start+join, ``preloads`` given as an
    explicit list (``set_forkserver_preload(['__main__'])`` preloads nothing on 3.11), n runs.

    Measured from a ``python -c`` program: started from a script, every child
    would re-import that script as ``__mp_main__`` and time its imports too.
    """
    return _samples(_FORKSERVER, preloads, n)


def spare_pipeline(preloads: list[str], n: int) -> list[float]:
    """Seconds per request through the minimal pre-forked-spare pipeline (see the module
    doc), ``preloads`` held by its server, n runs: a bound for what a Clone could cost."""
    return _samples(_PIPELINE, preloads, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=50, help="samples per path (default 50)")
    parser.add_argument("modules", nargs="*",
                        default=["json", "decimal", "asyncio", "email", "http.client"])
    opts = parser.parse_args()
    cold = cold_start(opts.modules, max(3, opts.n // 5))
    floor = fork_floor(opts.modules, opts.n)
    bound = spare_pipeline(opts.modules, opts.n)
    print(json.dumps({"preloads": opts.modules, "cold_start": percentiles(cold),
                      "fork_floor": percentiles(floor), "pipeline": percentiles(bound),
                      "pipeline_over_floor": round(statistics.median(bound)
                                                   / statistics.median(floor), 1),
                      "cold_over_floor": round(statistics.median(cold)
                                               / statistics.median(floor), 1)}))


if __name__ == "__main__":
    main()
