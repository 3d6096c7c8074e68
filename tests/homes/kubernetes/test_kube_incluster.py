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


def test_env_overrides_name_the_server_and_the_credentials(
    pod_env: dict[str, str], service_account: Path, tmp_path: Path
) -> None:
    base = {k: v for k, v in pod_env.items() if not k.startswith("KUBERNETES_SERVICE")}
    moved = tmp_path / "elsewhere"
    service_account.rename(moved)
    env = {**base, "SLURM_FIBER_KUBE_SERVER": "https://api.example:6443/",
           "SLURM_FIBER_KUBE_SERVICE_ACCOUNT_DIR": str(moved)}
    config = load_in_cluster(env, tmp_path / "no-such-dir")
    assert config.server == "https://api.example:6443"
    assert (config.token_file, config.ca_file) == (moved / "token", moved / "ca.crt")
    (moved / "namespace").write_text("other")  # not cross-checked with a token from elsewhere
    files = {**base, "SLURM_FIBER_KUBE_SERVER": "https://api.example:6443",
             "SLURM_FIBER_KUBE_TOKEN_FILE": str(moved / "token"),
             "SLURM_FIBER_KUBE_CA_FILE": str(moved / "ca.crt")}
    config = load_in_cluster(files, tmp_path / "no-such-dir")
    assert (config.token_file, config.ca_file) == (moved / "token", moved / "ca.crt")
    with pytest.raises(InClusterError, match="is not an https:// URL"):
        load_in_cluster({**files, "SLURM_FIBER_KUBE_SERVER": "http://api.example"}, moved)
    with pytest.raises(InClusterError, match="does not exist"):
        load_in_cluster({**files, "SLURM_FIBER_KUBE_TOKEN_FILE": str(tmp_path / "nope")}, moved)
