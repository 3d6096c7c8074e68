"""How long a client waits for fiberd, and through which misses: one definition for
fiberctl, fiberctl map and the Executor.

A client in a Slurm job may start before its job's fiberd listens or has warmed its
template, as ``srun`` waits for its step to be allocated: it waits through the misses in
``WAITED`` (and a socket not listening yet) up to ``DEFAULT_WAIT`` seconds. Every other
retryable miss (source_stale, fenced, denied, audit_failed) is answered at once.
"""

WAITED = frozenset({"cold", "capacity"})  # the misses a waiting client waits through
DEFAULT_WAIT = 300.0  # seconds a job's client waits through them (srun's way: long enough
# for a fiberd started in the same script to listen and warm its template)
