"""``slurm-fiber conform --home kubernetes``: the Kubernetes home on the fake API server.

And on a real kube-apiserver v1.20.2 (``RealKubernetesStage``) when one was
built here (``deploy/kubernetes/real-apiserver/build``); otherwise that test
is skipped with the reason (in CI, where the lane builds it, a skip fails).

Real processes throughout: the CLI in a subprocess, fiberd in it over real
HTTPS to the fake, templates and fibers. The home conforms (device holds
declared lacking, with the reason); a Kubernetes home that never reports
its Pod's deletion fails ``scope.loss``. The stage's pure helpers are
checked on their own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import pytest

from slurm_fiber.config import FiberdConfig
from slurm_fiber.conform.kubernetes import KubernetesStage, condition_sent
from slurm_fiber.conform.stage import Launch
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.seam import Home, ScopeLostHandler
from slurm_fiber.homes.problem import ProblemSink
from slurm_fiber.homes.select import BuiltHome, build_home
from slurm_fiber.testing.kubernetes import realserver
from tests.conform.conformkit import conform, outcomes

ALL_BUT_HOLDS = ("preadmission.warms", "removal.releases", "removal.denies",
                 "redelivery.lifts", "misses.fresh", "misses.stale", "misses.never",
                 "readiness.flips", "devices.provisioned", "scope.loss")


class ScopeBlind:
    """The real Kubernetes home, except that it never hands on a scope loss."""

    def __init__(self, inner: Home) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def on_scope_lost(self, handler: ScopeLostHandler) -> None:
        """Drops the handler: the Pod's deletion is never reported."""


class ScopeBlindStage(KubernetesStage):
    """The kubernetes stage with its home (built as fiberd builds it) made scope-blind."""

    def launch(self) -> Launch:
        base = super().launch()

        async def build(config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                        on_problem: ProblemSink) -> BuiltHome:
            built = await build_home(config, clock, environ, on_problem)
            return built.replaced(home=ScopeBlind(built.home))

        return Launch(base.config, base.environ, build)


def test_the_kubernetes_home_conforms_on_the_fake_api_server() -> None:
    began = time.monotonic()
    run = conform("--home", "kubernetes", "--json")
    took = time.monotonic() - began
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert outcomes(report) == {**dict.fromkeys(ALL_BUT_HOLDS, "pass"),
                                "devices.released": "declared-skip"}
    held = next(c for c in report["clauses"] if c["clause"] == "devices.released")
    assert "DRA claim" in held["reason"]
    assert "Traceback" not in run.stderr
    assert took < 60, f"conform --home kubernetes took {took:.1f} s"


@pytest.mark.parametrize("stage", ["RealKubernetesStage", "KilledRealKubernetesStage"])
def test_the_kubernetes_home_conforms_on_a_real_apiserver(stage: str) -> None:
    """Silenced by SIGSTOP (rounds time out) and by SIGKILL (connections refused)."""
    why = realserver.missing()
    if why is not None:
        pytest.skip(why)
    run = conform("--home", f"slurm_fiber.conform.kubernetes:{stage}", "--json", timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    devices = ("devices.provisioned", "devices.released")
    assert outcomes(report) == {**dict.fromkeys(set(ALL_BUT_HOLDS) - set(devices), "pass"),
                                **dict.fromkeys(devices, "declared-skip")}
    provisioned = next(c for c in report["clauses"] if c["clause"] == "devices.provisioned")
    assert "v1.20.2 has no DRA" in provisioned["reason"]
    assert "Traceback" not in run.stderr


def test_a_home_blind_to_its_pods_deletion_fails_scope_loss() -> None:
    run = conform("--home", "tests.conform.test_kubernetes:ScopeBlindStage",
                  "--clause", "scope.loss", "--json", "--settle", "1")
    assert run.returncode == 1, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert outcomes(report) == {"scope.loss": "fail"}
    assert "scope loss bumping the epoch or removing the grant: not seen" in \
        report["clauses"][0]["reason"]


def test_the_readiness_history_reads_the_gate_condition_of_each_status_patch() -> None:
    def body(*conditions: dict[str, str]) -> bytes:
        return json.dumps({"status": {"conditions": list(conditions)}}).encode()

    gate = {"type": "slurm-fiber.io/template-warm", "status": "True"}
    assert condition_sent(body(gate)) is True
    assert condition_sent(body({"type": "Ready", "status": "True"},
                               {**gate, "status": "False"})) is False
    assert condition_sent(body({"type": "Ready", "status": "True"})) is None
    assert condition_sent(body({**gate, "status": "Unknown"})) is None
    for junk in (b"", b"not json", b"[]", b'{"status": {"conditions": 3}}'):
        assert condition_sent(junk) is None
