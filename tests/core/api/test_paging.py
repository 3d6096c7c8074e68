"""``list_fibers`` page by page (protocol v3): complete across pages while fibers start and
end between them (nothing twice, nothing that stayed running missed), against the real
fiberd and as a property of ``service.page``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_fiber.client.connection import FiberdClient, Refused
from slurm_fiber.core.api.service import page
from slurm_fiber.protocol.limits import MAX_PAGE
from tests.core.runtime.fiberdkit import ThreadFiberd

SLEEP = {"exec": {"argv": ["sleep", "60"]}}


def start(client: FiberdClient, n: int, tag: str) -> list[str]:
    started = client.clone_batch([{"key": f"{tag}{i}", **SLEEP} for i in range(n)])
    return [f.id for f in started.fibers().values()]


def test_listing_is_complete_across_pages_while_fibers_start_and_end(
        fiberd_served: ThreadFiberd) -> None:
    with FiberdClient(fiberd_served.path) as client, \
            FiberdClient(fiberd_served.path) as other:
        first = start(client, 10, "a")
        listed: list[str] = []
        page1 = client.list_fibers(limit=4)
        listed += [f["id"] for f in page1.fibers]
        assert listed == first[:4] and page1.next is not None
        other.stop_fiber(first[1], 0.1)  # already listed: ends between pages
        other.stop_fiber(first[6], 0.1)  # not yet listed: ends between pages
        late = start(other, 3, "b")  # start between pages
        cursor, pages = page1.next, 1
        while cursor is not None:
            more = client.list_fibers(after=cursor, limit=4)
            listed += [f["id"] for f in more.fibers]
            cursor, pages = more.next, pages + 1
            if pages == 2:
                other.stop_fiber(late[0], 0.1)  # started and ended between pages
        assert len(listed) == len(set(listed))  # nothing twice
        stayed = [f for f in first if f not in (first[1], first[6])] + late[1:]
        assert set(stayed) <= set(listed)  # nothing that stayed running was missed
        assert first[6] not in listed
        assert [f["id"] for f in client.iter_fibers(page_size=3)] == \
               [f["id"] for f in client.list_fibers().fibers]  # paged == whole, in order
        for fid in stayed:
            client.stop_fiber(fid, 0.1)


def test_paging_needs_v3_and_a_cursor_fiberd_gave(fiberd_served: ThreadFiberd) -> None:
    with FiberdClient(fiberd_served.path) as client:
        for fields in ({"limit": 5}, {"v": 3, "limit": 0}, {"v": 3, "limit": MAX_PAGE + 1},
                       {"v": 3, "after": "x1"}, {"v": 3, "after": ""}):
            with pytest.raises(Refused) as refused:
                client.request("list_fibers", **fields)
            assert refused.value.code == "bad_request", fields
        assert client.list_fibers(after="99999").fibers == []


@given(st.lists(st.one_of(st.just("add"), st.integers(0, 30),
                          st.integers(1, 4).map(lambda n: ("page", n))), max_size=80))
def test_page_by_page_nothing_twice_and_nothing_present_at_the_end_missed(
        ops: list[object]) -> None:
    """Items come and go (orders only grow, as fibers' registration does) while pages are
    read; once the last page is read, every item there is then was seen, and none twice."""
    items: dict[int, str] = {}
    counter, cursor, seen = 0, None, []
    for op in [*ops, ("page", 1000)]:
        if op == "add":
            counter += 1
            items[counter] = f"f{counter}"
        elif isinstance(op, int):
            if items:
                del items[sorted(items)[op % len(items)]]
        else:
            assert isinstance(op, tuple)
            got, cursor = page(sorted(items.items()), cursor, op[1])
            seen += got
            if cursor is None:
                assert len(seen) == len(set(seen))
                assert set(items.values()) <= set(seen)
                cursor, seen = None, []  # a new listing starts
