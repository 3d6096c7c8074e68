"""Decision test kit: verified tokens built directly (the decisions never see crypto)."""

from __future__ import annotations

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.trust.grant import FiberSpec, Limits, VerifiedToken


def token(clock: FakeClock, uid: str = "g1", *, ttl: float = 600.0, jti: str | None = None,
          fibers: int | None = 2, seconds: float | None = None, iat: float | None = None,
          ) -> VerifiedToken:
    """A verified token for ``uid`` expiring ``ttl`` seconds from the clock's wall now."""
    now = clock.wall()
    return VerifiedToken(
        uid=uid, issuer="site", jti=jti or f"{uid}-{now + ttl}", audience=("job-1",),
        exp=now + ttl, iat=now if iat is None else iat, nbf=None,
        spec=FiberSpec(limits=Limits(fibers=fibers, seconds=seconds)), raw=b"",
    )
