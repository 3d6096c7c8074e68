"""deploy/kubernetes agrees with the code: env names, readiness gate, and the Role's exact verbs."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import yaml

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes.kubernetes import incluster
from slurm_fiber.homes.kubernetes.api import KubeApi
from slurm_fiber.homes.kubernetes.incluster import InClusterConfig
from slurm_fiber.homes.select import load_config
from slurm_fiber.testing.kubernetes.fake import DEFAULT_GATE, FakeApiServer

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
VERBS = {"GET": "get", "PATCH": "patch"}
PATH = re.compile(r"^/apis?/(?:(?P<group>[^/]+)/)?v1/namespaces/[^/]+/(?P<plural>[^/]+)/[^/]+"
                  r"(?P<sub>/status)?$")


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def the(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs(name) if d["kind"] == kind)


def test_pod_manifest_carries_what_load_in_cluster_reads() -> None:
    pod = the("Pod", "grant-pod.yaml")
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
           for e in container["env"] if "valueFrom" in e}
    assert env == {
        incluster.ENV_POD_NAME: "metadata.name",
        incluster.ENV_POD_NAMESPACE: "metadata.namespace",
        incluster.ENV_POD_UID: "metadata.uid",
        incluster.ENV_NODE_NAME: "spec.nodeName",
        incluster.ENV_SERVICE_ACCOUNT: "spec.serviceAccountName",
    }
    assert pod["spec"]["readinessGates"] == [{"conditionType": DEFAULT_GATE}]
    assert [c["name"] for c in container["resources"]["claims"]] == [
        c["name"] for c in pod["spec"]["resourceClaims"]]
    template = the("ResourceClaimTemplate", "resourceclaimtemplate.yaml")
    assert {c["resourceClaimTemplateName"] for c in pod["spec"]["resourceClaims"]} == {
        template["metadata"]["name"]}
    secret = the("Secret", "grant-pod.yaml")
    (volume,) = pod["spec"]["volumes"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert all(key.endswith(".jwt") for key in secret["stringData"])
    assert pod["spec"]["serviceAccountName"] == the("ServiceAccount", "rbac.yaml")["metadata"][
        "name"]


def test_pod_manifest_configures_fiberd_for_its_secret_and_readiness_gate() -> None:
    pod = the("Pod", "grant-pod.yaml")
    (container,) = pod["spec"]["containers"]
    settings = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    config = load_config(env=settings, flags={"home": container["command"][2]})
    (mount,) = container["volumeMounts"]
    assert config.home == "kubernetes"
    assert config.grantdir == mount["mountPath"] and mount["readOnly"] is True
    condition = config.home_options["ready_condition"]
    assert pod["spec"]["readinessGates"] == [{"conditionType": condition}]


def test_role_grants_exactly_what_the_home_calls(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, claim_name: str
) -> None:
    async def every_call() -> None:
        api = KubeApi(in_cluster, clock=clock)
        try:
            await api.read_pod()
            await api.read_claim(claim_name)
            await api.set_condition(DEFAULT_GATE, True, reason="Warm", message="warm")
        finally:
            await api.aclose()

    asyncio.run(every_call())
    used = set()
    for seen in fake.seen:
        match = PATH.match(seen.path)
        assert match, seen.path
        resource = match["plural"] + (match["sub"] or "")
        used.add((match["group"] or "", resource, VERBS[seen.method]))
    role = the("Role", "rbac.yaml")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == used
    binding = the("RoleBinding", "rbac.yaml")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
