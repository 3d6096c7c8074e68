"""The files of one standalone fiberd's site: an issuer, its state dir and its grantdir.

``Site(root, issuer=..., audience=...)`` lays out ``root/state`` and
``root/state/grants`` (both 0700, the caller's) and an ``Issuer`` whose JWKS
is ``root/<jwks_name>``. ``drop`` writes a grant file ``<uid>.jwt`` whole
(``safefs.replace_file``), as an admin tool would; ``remove`` deletes it.
A fiberd pointed at ``state`` with ``issuer.trust`` and ``audience`` admits
what is dropped. Nothing here starts a process.
"""

from __future__ import annotations

from pathlib import Path

from slurm_fiber.core.trust.grant import FiberSpec
from slurm_fiber.core.trust.mint import PrivateKey, generate_key
from slurm_fiber.safefs import replace_file
from slurm_fiber.testing.issuer import Issuer

GRANT_MODE = 0o644


class Site:
    """An issuer and the state dir and grantdir of one standalone fiberd under ``root``."""

    def __init__(self, root: Path, *, issuer: str = "site", audience: str = "site",
                 jwks_name: str = "site.jwks.json", key: PrivateKey | None = None) -> None:
        self.root = root
        self.audience = audience
        self.state = root / "state"
        self.grantdir = self.state / "grants"
        self.grantdir.mkdir(parents=True, mode=0o700)
        self.state.chmod(0o700)
        self.issuer = Issuer(issuer, root / jwks_name, key or generate_key())

    @property
    def key(self) -> PrivateKey:
        return self.issuer.key

    @property
    def jwks(self) -> Path:
        return self.issuer.jwks

    def mint(self, uid: str, spec: FiberSpec | None = None, *, ttl: float = 3600.0,
             audience: str | None = None) -> str:
        """A grant for ``uid`` from this site's issuer (for its audience unless given)."""
        return self.issuer.mint(uid, audience or self.audience, spec, ttl=ttl)

    def drop_token(self, uid: str, token: str) -> str:
        """Write ``token`` as the grant file ``<uid>.jwt``, whole; returns it."""
        replace_file(self.grantdir / f"{uid}.jwt", token.encode(), mode=GRANT_MODE)
        return token

    def remove(self, uid: str) -> None:
        """Delete the grant file ``<uid>.jwt``."""
        (self.grantdir / f"{uid}.jwt").unlink()
