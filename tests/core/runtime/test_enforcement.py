"""The enforcement record in the runtime: admission predicts it, carving confirms it.

A controller can be enabled on the carving root and the grant's limit file
still not be written (the kernel refuses the write, or the file is not
there): the record then says "not enforced", an ``enforcement`` audit
record tells what changed since the admit record, and under strict limits
the grant is refused before any template starts. Exercised on a fake cgroup
tree (plain files offering controllers the grant cgroup then lacks), since
a real kernel refuses such writes only in rare states.
"""

from __future__ import annotations

import json
from pathlib import Path

from slurm_fiber.core.book.misses import Miss, MissCode
from tests.core.processkit import aio, marked_procs
from tests.core.runtime.fiberdkit import Site, running_fiberd, until


def fake_root(path: Path) -> Path:
    """A directory that passes for a cgroup v2 root offering memory, pids and cpu."""
    path.mkdir()
    (path / "cgroup.controllers").write_text("memory pids cpu\n")
    (path / "cgroup.subtree_control").write_text("")
    (path / "cgroup.procs").write_text("")
    return path


def audit_events(site: Site) -> list[dict[str, object]]:
    return [json.loads(line) for line in (site.state / "audit.jsonl").read_text().splitlines()]


@aio
async def test_a_limit_not_written_at_carving_is_audited_and_refused_under_strict_limits(
    site: Site, tmp_path: Path
) -> None:
    root = fake_root(tmp_path / "cg")
    site.drop(memory=64 << 20)
    async with running_fiberd(site, cgroup_root=str(root), strict_limits="true") as live:
        await until(lambda: any(e.get("code") == "unenforceable" for e in audit_events(site)))
        for grant in ("g1", None):
            miss = await live.clone(grant)
            assert isinstance(miss, Miss) and miss.code is MissCode.UNENFORCEABLE
            assert "memory" in miss.reason and not miss.retryable
        assert live.core.status()["enforcement"]["grants"] == {}  # type: ignore[index]
        assert not marked_procs(site.mark)  # no template was started
    events = audit_events(site)
    (admit,) = [e for e in events if e["event"] == "admit"]
    assert admit["enforcement"]["unenforced"] == []  # type: ignore[index]  # as predicted
    (carved,) = [e for e in events if e["event"] == "enforcement"]
    assert carved["enforcement"]["unenforced"] == ["memory"]  # type: ignore[index]
    (refused,) = [e for e in events if e["event"] == "refuse"]
    assert refused["code"] == "unenforceable" and refused["uid"] == "g1"
