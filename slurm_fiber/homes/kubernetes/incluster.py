"""In-cluster configuration: how fiberd, a grant Pod's container, finds and trusts its API server.

The kubelet gives every container the API server's address
(``KUBERNETES_SERVICE_HOST``/``_PORT``) and a projected service account
volume (``token``, ``ca.crt``, ``namespace``); the grant Pod's manifest adds
the Pod's own identity through the downward API (``SLURM_FIBER_POD_NAME``,
``_POD_NAMESPACE``, ``_POD_UID``, ``_NODE_NAME``, ``_SERVICE_ACCOUNT``).
``load_in_cluster`` reads them once and refuses, with one line a person can
act on, anything missing or inconsistent. The token is re-read from its file
every round (``api.PodToken``), so kubelet's token rotation needs no restart.

Overrides, for tests and for running fiberd against an API server from
outside a Pod (the downward-API variables are still required):

- ``SLURM_FIBER_KUBE_SERVER``: the API server's ``https://`` URL, instead of
  ``KUBERNETES_SERVICE_HOST``/``_PORT``;
- ``SLURM_FIBER_KUBE_SERVICE_ACCOUNT_DIR``: the directory holding ``token``,
  ``ca.crt`` and ``namespace``, instead of the service account volume;
- ``SLURM_FIBER_KUBE_TOKEN_FILE`` and ``SLURM_FIBER_KUBE_CA_FILE``: the
  bearer token and the CA bundle, file by file. With a token file from
  elsewhere, the service account's ``namespace`` file is not cross-checked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lightkube import KubeConfig
from lightkube.config.models import Cluster, User

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ENV_POD_NAME = "SLURM_FIBER_POD_NAME"
ENV_POD_NAMESPACE = "SLURM_FIBER_POD_NAMESPACE"
ENV_POD_UID = "SLURM_FIBER_POD_UID"
ENV_NODE_NAME = "SLURM_FIBER_NODE_NAME"
ENV_SERVICE_ACCOUNT = "SLURM_FIBER_SERVICE_ACCOUNT"
ENV_SERVER = "SLURM_FIBER_KUBE_SERVER"
ENV_SERVICE_ACCOUNT_DIR = "SLURM_FIBER_KUBE_SERVICE_ACCOUNT_DIR"
ENV_TOKEN_FILE = "SLURM_FIBER_KUBE_TOKEN_FILE"
ENV_CA_FILE = "SLURM_FIBER_KUBE_CA_FILE"


class InClusterError(Exception):
    """The Pod's environment does not describe a usable in-cluster configuration (one line)."""


@dataclass(frozen=True)
class PodIdentity:
    """Who fiberd is: its Pod's name, namespace and UID; node and service account when given."""

    name: str
    namespace: str
    uid: str
    node: str | None = None
    service_account: str | None = None


@dataclass(frozen=True)
class InClusterConfig:
    """Where the API server is, how to trust and authenticate to it, and which Pod this is."""

    server: str
    ca_file: Path
    token_file: Path
    pod: PodIdentity

    def kubeconfig(self) -> KubeConfig:
        """A lightkube configuration: CA-verified TLS, bearer token re-read from its file."""
        return KubeConfig.from_one(
            cluster=Cluster(server=self.server, certificate_auth=str(self.ca_file)),
            user=User(token_file=str(self.token_file)),
            namespace=self.pod.namespace,
        )


def load_in_cluster(
    env: Mapping[str, str] | None = None, service_account_dir: Path = SERVICE_ACCOUNT_DIR
) -> InClusterConfig:
    """Read the container's in-cluster configuration; blocks only on small file reads.

    ``env`` defaults to the process environment; its ``SLURM_FIBER_KUBE_*``
    overrides (see the module text) win over ``service_account_dir`` and the
    service variables. Raises InClusterError naming the variable or file
    that is missing, empty or inconsistent.
    """
    env = os.environ if env is None else env
    server = _server(env)
    if env.get(ENV_SERVICE_ACCOUNT_DIR, "").strip():
        service_account_dir = Path(env[ENV_SERVICE_ACCOUNT_DIR].strip())
    token_file = _path_override(env, ENV_TOKEN_FILE) or service_account_dir / "token"
    ca_file = _path_override(env, ENV_CA_FILE) or service_account_dir / "ca.crt"
    if not _read(token_file):
        raise InClusterError(f"{token_file} is empty: is the service account token mounted?")
    if not _read(ca_file):
        raise InClusterError(f"{ca_file} is empty: is the service account CA mounted?")
    hint = "add it from the downward API (see deploy/kubernetes)"
    pod = PodIdentity(
        name=_required(env, ENV_POD_NAME, hint),
        namespace=_required(env, ENV_POD_NAMESPACE, hint),
        uid=_required(env, ENV_POD_UID, hint),
        node=env.get(ENV_NODE_NAME) or None,
        service_account=env.get(ENV_SERVICE_ACCOUNT) or None,
    )
    own_token = _path_override(env, ENV_TOKEN_FILE) is None
    sa_namespace = _read(service_account_dir / "namespace") if own_token else ""
    if sa_namespace and sa_namespace != pod.namespace:
        raise InClusterError(
            f"{ENV_POD_NAMESPACE}={pod.namespace!r} but the service account's namespace is "
            f"{sa_namespace!r}: fix the downward API env"
        )
    return InClusterConfig(server, ca_file, token_file, pod)


def _server(env: Mapping[str, str]) -> str:
    """The API server's URL: the override, else the kubelet's service variables."""
    override = env.get(ENV_SERVER, "").strip().rstrip("/")
    if override:
        if not override.startswith("https://") or len(override) <= len("https://"):
            raise InClusterError(f"{ENV_SERVER}={override!r} is not an https:// URL")
        return override
    host = _required(env, "KUBERNETES_SERVICE_HOST", "not running in a Pod?")
    port = _required(env, "KUBERNETES_SERVICE_PORT", "not running in a Pod?")
    if not port.isdigit():
        raise InClusterError(f"KUBERNETES_SERVICE_PORT={port!r} is not a port number")
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{port}"


def _path_override(env: Mapping[str, str], name: str) -> Path | None:
    value = env.get(name, "").strip()
    return Path(value) if value else None


def _required(env: Mapping[str, str], name: str, hint: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise InClusterError(f"{name} is not set: {hint}")
    return value


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise InClusterError(f"{path} does not exist: is the service account mounted?") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InClusterError(f"{path} cannot be read: {err}") from None
