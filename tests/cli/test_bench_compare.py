"""bench/compare.py runs one bench script from two checkouts, alternated, and prints each
figure's medians side by side; a failing run stops it with the run's exit status named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

COMPARE = Path(__file__).resolve().parents[2] / "bench" / "compare.py"
SCRIPT = """import json, pathlib, sys
count = pathlib.Path(sys.argv[0]).with_suffix(".count")
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
if {fail}: sys.exit(3)
print("progress line")
print(json.dumps({{"x": {x} * n, "nested": {{"y": [{x}, {x}]}}, "flag": True, "name": "s"}}))
"""


def checkout(root: Path, x: int, fail: bool = False) -> Path:
    (root / "bench").mkdir(parents=True)
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (root / "bench" / "figs.py").write_text(SCRIPT.format(x=x, fail=fail))
    return root


def test_compare_alternates_and_prints_medians_and_ratios(tmp_path: Path) -> None:
    a, b = checkout(tmp_path / "a", 1), checkout(tmp_path / "b", 2)
    out = subprocess.run([sys.executable, str(COMPARE), "--a", str(a), "--b", str(b),
                          "--rounds", "3", "figs.py"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    figures = result["figures"]
    # each side ran three times: x is 1, 2, 3 times its value, so the median is twice it
    assert figures["x"] == {"a": 2.0, "b": 4.0, "b_over_a": 2.0}
    assert figures["nested.y.1"]["b_over_a"] == 2.0
    assert "flag" not in figures and "name" not in figures
    assert [line.split(" = ")[0] for line in out.stderr.splitlines()] == [
        f"round {i}/3: {side}" for i in (1, 2, 3) for side in ("a", "b")]


def test_a_failing_run_stops_the_comparison_and_says_which(tmp_path: Path) -> None:
    a, b = checkout(tmp_path / "a", 1), checkout(tmp_path / "b", 2, fail=True)
    out = subprocess.run([sys.executable, str(COMPARE), "--a", str(a), "--b", str(b),
                          "figs.py"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "figs.py exited 3" in out.stderr
