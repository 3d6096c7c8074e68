"""The module-scoped real fiberd the Executor tests share (tests/executor/sitekit.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from slurm_fiber.cli.throwaway import Site
from tests.executor.sitekit import started_site, stop_site


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    s = started_site(tmp_path_factory.mktemp("site"))
    yield s
    stop_site(s)
