"""Services (issue 40, item 4): the systemd units in contrib/systemd pass `systemd-analyze
verify` with no warning (ExecStart pointed at this venv's commands, as a site points it
at its install), and say what a standalone fiberd needs: Type=notify, Delegate=yes, the
hardening that leaves fibers what their grants allow. The Kubernetes manifests name the
image deploy/kubernetes/Dockerfile builds and expose fiberd's metrics port."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
UNITS = sorted((REPO / "contrib" / "systemd").glob("*.service"))
BIN = Path(sys.executable).parent


def directives(unit: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_systemd_analyze_verifies_the_unit(unit: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: apt-get install systemd (./dev test does)"
    local = tmp_path / unit.name
    local.write_text(unit.read_text().replace("/opt/slurm-fiber/bin", str(BIN)))
    done = subprocess.run([analyze, "verify", "--man=no", str(local)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), \
        done.stdout + done.stderr


def test_the_fiberd_unit_is_notify_delegated_and_hardened_to_fit() -> None:
    unit = directives(REPO / "contrib" / "systemd" / "fiberd.service")
    assert unit["Type"] == ["notify"] and unit["Delegate"] == ["yes"]
    assert unit["NoNewPrivileges"] == ["yes"] and unit["ProtectSystem"] == ["strict"]
    assert unit["StateDirectory"] == ["slurm-fiber"]
    assert "ProtectControlGroups" not in unit  # fiberd writes its delegated cgroups
    assert "PrivateDevices" not in unit  # grants hand out devices
    (start,) = unit["ExecStart"]
    assert start.split()[0] == "/opt/slurm-fiber/bin/fiberd" and "--home standalone" in start


def test_kubernetes_manifests_name_the_built_image_and_expose_the_metrics_port() -> None:
    dockerfile = (REPO / "deploy" / "kubernetes" / "Dockerfile").read_text()
    build = (REPO / "deploy" / "kubernetes" / "build-image").read_text()
    (image,) = set(re.findall(r'^IMAGE = "([^"]+)"', build, re.M))
    assert "EXPOSE 9464" in dockerfile
    pods = [doc for doc in yaml.safe_load_all((REPO / "deploy" / "kubernetes" /
                                               "grant-pod.yaml").read_text())
            if doc and doc["kind"] == "Pod"]
    assert pods
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["image"].startswith(image.split(":")[0])
        assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in \
            container["ports"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["FIBERD_METRICS_LISTEN"] == "0.0.0.0:9464"
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9464"
