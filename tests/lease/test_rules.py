"""One test per rule sentence of seed 002, on fixed times (the rules are pure)."""

from __future__ import annotations

import pytest

from slurm_fiber.lease.rules import Gate, Refusal, check, gate_for, pending, prune, watch_supervisor
from slurm_fiber.lease.state import Grant, Party, State, Supervisor, Upgrade

T0 = 1_800_000_000.0
TTL = 600.0
SUP = Party(session="sup")
A, B, C = Party(session="a"), Party(session="b"), Party(session="c")


def grant(res: str, to: Party, at: float = T0, unblock: str = "") -> Grant:
    return Grant(res, to, SUP, at, unblock)


def supervised(*grants: Grant) -> State:
    return State(supervisor=Supervisor(SUP, since=T0 - 100), grants=list(grants))


def gate(st: State, caller: Party, res: str = "gpu0", now: float = T0 + 1, **kw: object) -> Gate:
    base = gate_for(st, res, caller, False, now, TTL)
    return Gate(**{**vars(base), **kw})  # type: ignore[arg-type]


def test_without_supervisor_a_free_lease_is_permission() -> None:
    assert check(State(), gate(State(), A)) == -1


def test_while_a_supervisor_is_recorded_a_free_lease_is_not_permission() -> None:
    st = supervised()
    with pytest.raises(Refusal, match="a free lease is not a grant") as err:
        check(st, gate(st, A))
    assert err.value.position == 0


def test_a_session_claims_only_what_the_supervisor_granted_it() -> None:
    st = supervised(grant("gpu0", A), grant("gpu1", B))
    assert check(st, gate(st, A, "gpu0")) == 0
    with pytest.raises(Refusal, match="not a grant"):
        check(st, gate(st, A, "gpu1"))


def test_grants_are_claimed_in_the_order_given_with_position_and_ahead() -> None:
    st = supervised(grant("gpu0", A), grant("gpu0", B, T0 + 1), grant("gpu0", C, T0 + 2))
    with pytest.raises(Refusal) as err:
        check(st, gate(st, C))
    assert (err.value.position, err.value.ahead) == (3, "a")
    assert "number 3" in str(err.value) and "\n" not in str(err.value)
    assert check(st, gate(st, A)) == 0
    st.grants.pop(0)  # A's claim consumed its grant
    assert check(st, gate(st, B)) == 0


def test_rule_holds_whether_the_supervisor_runs_or_has_crashed() -> None:
    st = supervised(grant("gpu0", A))
    crashed = gate(st, A, restart_until=T0 + 60)
    gone = gate(st, A, gone=True)
    assert check(st, crashed) == 0 and check(st, gone) == 0
    with pytest.raises(Refusal, match="is restarting"):
        check(st, gate(st, B, restart_until=T0 + 60))
    with pytest.raises(Refusal, match=r"is gone: .* until its successor starts"):
        check(st, gate(st, B, gone=True))


def test_the_rule_ends_only_with_a_deliberate_stop() -> None:
    st = supervised()
    st.supervisor = None  # what `supervise stop` does
    assert check(st, gate(st, B)) == -1


def test_the_supervisor_itself_and_a_person_need_no_grant() -> None:
    st = supervised()
    assert check(st, gate(st, SUP)) == -1
    assert check(st, gate(st, Party(person="ann", host="vm"))) == -1


def test_during_an_upgrade_only_an_upgrade_unblock_grant_admits_in_grant_order() -> None:
    st = supervised(
        grant("kind-lab", A),
        grant("kind-lab", B, T0 + 1, unblock="fix the CRDs"),
        grant("kind-lab", C, T0 + 2, unblock="check the rollout"),
    )
    st.upgrades.append(Upgrade("kind-lab", "v2 upgrade", SUP, T0))
    with pytest.raises(Refusal, match="upgrade 'v2 upgrade' runs"):
        check(st, gate(st, A, "kind-lab"))
    with pytest.raises(Refusal, match="upgrade 'v2 upgrade' runs"):
        check(st, gate(st, SUP, "kind-lab"))
    with pytest.raises(Refusal) as err:
        check(st, gate(st, C, "kind-lab"))
    assert (err.value.position, err.value.ahead) == (2, "b")
    assert check(st, gate(st, B, "kind-lab")) == 1


def test_an_upgrade_applies_to_the_installation_of_the_resource_name_only() -> None:
    st = State(upgrades=[Upgrade("kind-lab", "v2", SUP, T0, until=T0 + 50)])
    assert check(st, gate(st, A, "gpu0")) == -1
    with pytest.raises(Refusal):
        check(st, gate(st, A, "kind-lab"))
    assert check(st, gate(st, A, "kind-lab", now=T0 + 50)) == -1  # its time ended


def test_pending_lists_claimable_grants_in_order_and_drops_expired() -> None:
    st = supervised(grant("gpu0", A), grant("gpu0", B, T0 + 300), grant("gpu1", C))
    assert [g.to for g in pending(st, "gpu0", False, T0 + 10, TTL)] == [A, B]
    assert [g.to for g in pending(st, "gpu0", False, T0 + TTL + 1, TTL)] == [B]
    assert [g.to for g in pending(st, "gpu0", True, T0 + 10 * TTL, TTL)] == [A, B]


def test_ttl_runs_from_the_later_of_grant_and_last_release() -> None:
    st = supervised(grant("gpu0", A))
    st.released["gpu0"] = T0 + 500
    assert pending(st, "gpu0", False, T0 + 1000, TTL) != []
    assert pending(st, "gpu0", False, T0 + 1101, TTL) == []


def test_prune_drops_expired_grants_except_of_held_resources() -> None:
    st = supervised(grant("gpu0", A), grant("gpu1", B), grant("gpu2", C, T0 + 700))
    dropped = prune(st, {"gpu1"}, T0 + 701, TTL)
    assert [g.resource for g in dropped] == ["gpu0"]
    assert [g.resource for g in st.grants] == ["gpu1", "gpu2"]


def test_restart_window_then_gone() -> None:
    sup = Supervisor(SUP, since=T0)
    watch_supervisor(sup, alive=False, now=T0, grace=120)
    assert (sup.restart_until, sup.gone) == (T0 + 120, False)
    watch_supervisor(sup, alive=False, now=T0 + 119, grace=120)
    assert sup.restart_until == T0 + 120
    watch_supervisor(sup, alive=False, now=T0 + 120, grace=120)
    assert (sup.restart_until, sup.gone) == (None, True)
    watch_supervisor(sup, alive=True, now=T0 + 500, grace=120)
    assert (sup.restart_until, sup.gone) == (None, False)


def test_refusal_is_one_line_with_its_fields() -> None:
    err = Refusal("gpu0 is granted to a first", 2, "a")
    assert str(err) == "gpu0 is granted to a first"
    assert (err.reason, err.position, err.ahead) == ("gpu0 is granted to a first", 2, "a")
