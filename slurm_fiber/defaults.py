"""The default paths and file names every part of slurm_fiber agrees on, in one place.

``STATE_DIR`` is where fiberd keeps its state outside a job and the node's
state root on Slurm (site config ``state_root``). The names are the files and
dirs fiberd keeps in a state dir; fiberd's options (config), the Slurm
layout (homes.slurm.paths) and the clients (discovery, ``slurm-fiber
audit``) all take them from here, so both ends of a socket or a log agree
without configuration. Constants only, all strings: fiberctl imports it, and
its import budget (tests/cli/test_fiberctl.py) leaves pathlib out.
"""

STATE_DIR = "/var/lib/slurm-fiber"
SOCKET_NAME = "fiberd.sock"  # the local API's Unix socket
AUDIT_NAME = "audit.jsonl"  # fiberd's audit log
GRANTDIR_NAME = "grants"  # the grantdir a file-fed home polls
READY_NAME = "ready.json"  # the readiness file
STATE_FILE_NAME = "grantbook.json"  # the grant book's state, kept across restarts
