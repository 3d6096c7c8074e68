"""The docs site (issue 40, item 6): `mkdocs build --strict` passes, and the built site,
served over HTTP and opened in headless Chromium, renders its pages (the generated
reference included) and finds pages with its search. The search's screenshot is kept as
.run/artifacts/docs-search.png (a CI artefact)."""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.release.chromekit import Chromium

REPO = Path(__file__).resolve().parents[2]
ARTIFACT = REPO / ".run" / "artifacts" / "docs-search.png"
# page -> (its title, a phrase of its body)
PAGES = {
    "": ("slurm_fiber", "Where to start"),
    "install/": ("Install", "slurm-fiber files"),
    "guides/job-author/": ("Job author's guide", "fiberctl map"),
    "guides/hpc-admin/": ("HPC admin's guide", "slurm-fiber-epilog"),
    "guides/platform-engineer/": ("Platform engineer's guide", "Delegate=yes"),
    "guides/monitoring/": ("Monitoring", "slurm_fiber_fiber_ends_total"),
    "troubleshooting/": ("Troubleshooting", "out of memory"),
    "benchmarks/": ("Benchmarks", "GNU parallel"),
    "reference/commands/fiberctl/": ("fiberctl(1)", "--socket"),
    "reference/commands/fiberd/": ("fiberd(8)", "--metrics-listen"),
    "reference/configuration/": ("Configuration", "metrics_listen"),
    "reference/exit-codes/": ("Exit codes", "EXIT_UNREACHABLE"),
    "changelog/": ("Changelog", "Keep a Changelog"),
    "socket-protocol/": ("fiberd socket protocol (v5)", "metrics"),
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_mkdocs_builds_strict_with_the_generated_reference(site: Path) -> None:
    for page in PAGES:
        assert (site / page / "index.html").is_file(), page
    assert (site / "search" / "search_index.json").is_file()


def test_pages_render_in_chromium(served: str) -> None:
    with Chromium() as browser:
        for page, (title, phrase) in PAGES.items():
            browser.open(served + page)
            heading = browser.until("document.querySelector('article h1')?.innerText")
            assert heading.replace("¶", "").strip() == title, page
            body = browser.evaluate("document.querySelector('article').innerText")
            assert phrase in body, f"{page}: no {phrase!r}"
            assert browser.evaluate("document.querySelectorAll('.md-nav__link').length") > 10


def test_search_finds_pages_and_its_screenshot_is_kept(served: str, tmp_path: Path) -> None:
    with Chromium() as browser:
        browser.open(served + "?q=node_exporter")
        count = browser.until("document.querySelectorAll('.md-search-result__item').length")
        assert count >= 1
        links = browser.evaluate("[...document.querySelectorAll('.md-search-result__link')]"
                                 ".map(a => a.href)")
        assert any("guides/monitoring/" in link for link in links), links
        shot = browser.screenshot(tmp_path / "docs-search.png")
    assert shot.stat().st_size > 10_000
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(shot, ARTIFACT)
