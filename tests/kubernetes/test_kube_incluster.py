"""load_in_cluster reads what kubelet and the downward API give a container, or refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_fiber.homes.kubernetes.incluster import InClusterError, load_in_cluster


def test_reads_the_pod_identity_and_server(
    pod_env: dict[str, str], service_account: Path
) -> None:
    config = load_in_cluster(pod_env, service_account)
    assert config.server == f"https://127.0.0.1:{pod_env['KUBERNETES_SERVICE_PORT']}"
    assert config.pod.name == "grant-pod-1"
    assert config.pod.namespace == "grants"
    assert config.pod.uid == pod_env["SLURM_FIBER_POD_UID"]
    assert (config.pod.node, config.pod.service_account) == ("node-1", "slurm-fiber")
    single = config.kubeconfig().get()
    assert single.namespace == "grants"
    assert single.user is not None and single.user.token_file == str(service_account / "token")
    assert single.cluster.certificate_auth == str(service_account / "ca.crt")


def test_optional_fields_and_ipv6(pod_env: dict[str, str], service_account: Path) -> None:
    env = {**pod_env, "KUBERNETES_SERVICE_HOST": "fd00::1"}
    del env["SLURM_FIBER_NODE_NAME"], env["SLURM_FIBER_SERVICE_ACCOUNT"]
    config = load_in_cluster(env, service_account)
    assert config.server.startswith("https://[fd00::1]:")
    assert config.pod.node is None and config.pod.service_account is None


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"KUBERNETES_SERVICE_HOST": ""}, "KUBERNETES_SERVICE_HOST is not set"),
        ({"KUBERNETES_SERVICE_PORT": "https"}, "is not a port number"),
        ({"SLURM_FIBER_POD_UID": ""}, "SLURM_FIBER_POD_UID is not set"),
        ({"SLURM_FIBER_POD_NAMESPACE": "other"}, "service account's namespace is 'grants'"),
    ],
)
def test_env_refusals(
    pod_env: dict[str, str], service_account: Path, change: dict[str, str], says: str
) -> None:
    with pytest.raises(InClusterError, match=says) as caught:
        load_in_cluster({**pod_env, **change}, service_account)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("file", "content", "says"),
    [
        ("token", "", "token is empty"),
        ("ca.crt", None, "ca.crt does not exist"),
        ("namespace", b"\xff\xfe", "cannot be read"),
    ],
)
def test_file_refusals(
    pod_env: dict[str, str], service_account: Path, file: str, content: object, says: str
) -> None:
    path = service_account / file
    if content is None:
        path.unlink()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(str(content))
    with pytest.raises(InClusterError, match=says):
        load_in_cluster(pod_env, service_account)
