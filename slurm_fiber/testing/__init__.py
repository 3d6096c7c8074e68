"""What tests, the conformance harness, the quickstart and the benches share to stand up a site.

``issuer`` (a throwaway signing key, its JWKS and the grant tokens it mints),
``site`` (that issuer plus the directories and grantdir of one standalone
fiberd), ``inprocess`` (fiberd started on the caller's event loop exactly as
the ``fiberd`` command starts it, and stopped cleanly) and ``kubernetes``
(an in-memory Kubernetes API server and a runner for a real kube-apiserver).

Nothing here is part of the product: the import-linter contracts in
pyproject.toml let only ``slurm_fiber.conform`` and the quickstart's
``slurm_fiber.cli.quickstart``/``slurm_fiber.cli.throwaway`` import it (and
tests and bench/, outside the package). Keys made here live in memory or in
the caller's directories and are never trusted by anything else.
"""

from slurm_fiber.testing.issuer import Issuer
from slurm_fiber.testing.site import Site

__all__ = ["Issuer", "Site"]
