"""core/identity.py: whom a fiberd's templates and fibers run as (``fiber_user``)."""

from __future__ import annotations

import pytest

from slurm_fiber.core.runtime.identity import IdentityRefused, resolve_fiber_user


def test_a_user_fiberd_keeps_its_own_account_and_cannot_name_another() -> None:
    assert resolve_fiber_user(None, euid=1234) is None
    assert resolve_fiber_user("1234", euid=1234) is None
    with pytest.raises(IdentityRefused, match="only a root fiberd"):
        resolve_fiber_user("root", euid=1234)


def test_a_root_fiberd_must_name_the_account_and_root_only_as_root() -> None:
    with pytest.raises(IdentityRefused, match="a root fiberd needs fiber_user"):
        resolve_fiber_user(None, euid=0)
    with pytest.raises(IdentityRefused, match='write fiber_user = "root"'):
        resolve_fiber_user("0", euid=0)
    with pytest.raises(IdentityRefused, match="no such user"):
        resolve_fiber_user("sf-nobody-here", euid=0)
    root = resolve_fiber_user("root", euid=0)
    assert root is not None and root.root and root.spawn_args() == {}
    nobody = resolve_fiber_user("nobody", euid=0)
    assert nobody is not None and not nobody.root
    assert nobody.spawn_args()["user"] == nobody.uid and nobody.to_json()["capabilities"] == "none"
