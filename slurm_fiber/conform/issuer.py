"""The harness's own control plane identity: a throwaway issuer that mints grant tokens.

grant-conform plays the issuer: ``ConformIssuer`` makes an Ed25519 key at
construction (``slurm_fiber.testing.Issuer``), writes its JWKS (owner-only)
for the stage to trust, and mints tokens for the grants the clauses need. Every grant's template
preloads ``slurm_fiber.conform.targets`` (the functions fibers run), runs
its warm hook, and carries ``SF_CONFORM_MARK`` so the harness can find any
process a clause leaves behind.
"""

from __future__ import annotations

from pathlib import Path

from slurm_fiber.conform.stage import Issuer
from slurm_fiber.core.trust.grant import FiberSpec, Limits, TemplateSpec
from slurm_fiber.procs import MARK_ENV
from slurm_fiber.testing import Issuer as TestIssuer

ISSUER_NAME = "grant-conform"
TARGETS = "slurm_fiber.conform.targets"


class ConformIssuer:
    """Mints tokens for one conformance run; ``mark`` tags every template and fiber."""

    def __init__(self, workdir: Path, mark: str) -> None:
        self.mark = mark
        self._issuer = TestIssuer(ISSUER_NAME, workdir / "issuer.jwks.json", jwks_mode=0o600)
        self.issuer = Issuer(ISSUER_NAME, self._issuer.jwks)

    def token(self, uid: str, audience: str, *, ttl: float = 3600.0,
              devices: tuple[str, ...] = ()) -> str:
        """A signed grant for ``uid`` valid ``ttl`` seconds from now (exp is whole seconds)."""
        spec = FiberSpec(
            template=TemplateSpec(preload=(TARGETS,), warm=f"{TARGETS}:warm",
                                  env={MARK_ENV: self.mark}),
            limits=Limits(), devices=devices)
        return self._issuer.mint(uid, audience, spec, ttl=ttl)
