"""A throwaway token issuer: a fresh signing key, its JWKS file, and the grants it mints.

``Issuer(name, jwks)`` makes an Ed25519 key (kept in memory) and writes the
public JWKS to ``jwks`` (replaced whole, ``jwks_mode``) for a fiberd to
trust as ``name``; ``mint`` signs a grant for a UID and audience, valid
``ttl`` seconds from now. A fiberd that does not name this JWKS in its
trust trusts nothing it mints.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from slurm_fiber.core.trust.grant import FiberSpec
from slurm_fiber.core.trust.issuers import public_jwk
from slurm_fiber.core.trust.mint import PrivateKey, generate_key, mint
from slurm_fiber.safefs import replace_file


@dataclass
class Issuer:
    """One issuer ``name`` whose public key is published at ``jwks``."""

    name: str
    jwks: Path
    key: PrivateKey = field(default_factory=generate_key)
    jwks_mode: int = 0o644

    def __post_init__(self) -> None:
        self.publish()

    def publish(self) -> None:
        """(Re)write the JWKS file with this issuer's public key."""
        replace_file(self.jwks, json.dumps({"keys": [public_jwk(self.key)]}).encode(),
                     mode=self.jwks_mode)

    @property
    def trust(self) -> str:
        """fiberd's ``--trust`` entry for this issuer (``name=jwks``)."""
        return f"{self.name}={self.jwks}"

    def mint(self, uid: str, audience: str, spec: FiberSpec | None = None, *,
             ttl: float = 3600.0) -> str:
        """A signed grant for ``uid`` and ``audience`` valid ``ttl`` seconds from now."""
        now = time.time()
        return mint(self.key, issuer=self.name, uid=uid, audience=audience, iat=now,
                    exp=now + ttl, spec=spec)
