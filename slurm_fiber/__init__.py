"""slurm_fiber: warm templates and millisecond fibers inside a batch allocation.

A grant (a signed token) says who may run what, on which devices, until when.
fiberd verifies grants, keeps a warm template process per grant and forks
fibers from it on request, each confined to a cgroup and the grant's devices
and stopped at min(lease, fence). The invariant core lives in
``slurm_fiber.core``; the environments that hold grants (standalone host,
Slurm allocation, Kubernetes Pod) live in ``slurm_fiber.homes``.
"""

__all__ = ["Executor", "__version__"]


def __getattr__(name: str) -> object:
    """``slurm_fiber.Executor`` and ``__version__``, looked up on first use: ``import
    slurm_fiber`` stays cheap (the hooks and fiberctl import the package on every run)."""
    if name == "__version__":
        from slurm_fiber.version import version

        return version()
    if name == "Executor":
        from slurm_fiber.client.executor import Executor

        return Executor
    raise AttributeError(f"module 'slurm_fiber' has no attribute {name!r}")
