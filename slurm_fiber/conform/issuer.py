"""The harness's own control plane identity: a throwaway issuer that mints grant tokens.

grant-conform plays the issuer: ``ConformIssuer`` makes an Ed25519 key at
construction, writes its JWKS (owner-only) for the stage to trust, and
mints tokens for the grants the clauses need. Every grant's template
preloads ``slurm_fiber.conform.targets`` (the functions fibers run), runs
its warm hook, and carries ``SF_CONFORM_MARK`` so the harness can find any
process a clause leaves behind.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from slurm_fiber.conform.stage import Issuer
from slurm_fiber.core.trust.grant import FiberSpec, Limits, TemplateSpec
from slurm_fiber.core.trust.issuers import public_jwk
from slurm_fiber.core.trust.mint import generate_key, mint
from slurm_fiber.procs import MARK_ENV

ISSUER_NAME = "grant-conform"
TARGETS = "slurm_fiber.conform.targets"


class ConformIssuer:
    """Mints tokens for one conformance run; ``mark`` tags every template and fiber."""

    def __init__(self, workdir: Path, mark: str) -> None:
        self.mark = mark
        self._key = generate_key()
        jwks = workdir / "issuer.jwks.json"
        fd = os.open(jwks, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"keys": [public_jwk(self._key)]}, out)
        self.issuer = Issuer(ISSUER_NAME, jwks)

    def token(self, uid: str, audience: str, *, ttl: float = 3600.0,
              devices: tuple[str, ...] = ()) -> str:
        """A signed grant for ``uid`` valid ``ttl`` seconds from now (exp is whole seconds)."""
        spec = FiberSpec(
            template=TemplateSpec(preload=(TARGETS,), warm=f"{TARGETS}:warm",
                                  env={MARK_ENV: self.mark}),
            limits=Limits(), devices=devices)
        now = time.time()
        return mint(self._key, issuer=ISSUER_NAME, uid=uid, audience=audience, iat=now,
                    exp=now + ttl, spec=spec)
