"""The lease package (seed 002): one holder at a time for a machine's shared resources.

A lease is a directory ``<leasedir>/<resource>/`` (mkdir is atomic) holding the
holder's record; while a supervisor is recorded, a session claims only what
the supervisor granted it, in grant order. ``Leases`` is the flow API other
code calls; ``Dir``, ``check``/``pending``/``prune`` are the parts it is made of.
The on-disk format is in docs/lease-format.md.
"""

from slurm_fiber.lease.dirlease import Dir
from slurm_fiber.lease.errors import LeaseError
from slurm_fiber.lease.holder import Holder, ProcessRef
from slurm_fiber.lease.leases import Caller, Leases
from slurm_fiber.lease.rules import Gate, Refusal, check, pending, prune
from slurm_fiber.lease.state import Grant, Party, State, Supervisor, Upgrade

__all__ = [
    "Caller", "Dir", "Gate", "Grant", "Holder", "LeaseError", "Leases", "Party", "ProcessRef",
    "Refusal", "State", "Supervisor", "Upgrade", "check", "pending", "prune",
]
