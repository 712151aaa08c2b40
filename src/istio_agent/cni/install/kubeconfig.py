"""The kubeconfig the istio-cni plugin uses to read pods: written by install-cni from its own service account.

Istio: ``cni/pkg/install/kubeconfig.go`` (which writes YAML; this writes JSON, see
docs/compatibility.md). The token is the service account's, so the file is written with
``kubeconfig-mode`` (0600) and logged only with the token redacted.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

from istio_agent.cni.install.settings import InstallSettings
from istio_agent.files import write_atomic

CLUSTER = "local"
CONTEXT = "istio-cni-context"
USER = "istio-cni"
REDACTED = "<redacted>"


class KubeconfigError(Exception):
    """The kubeconfig cannot be made; the message says what is missing."""


def build(settings: InstallSettings) -> dict[str, Any]:
    """The kubeconfig document; raises KubeconfigError when the API server or the credentials are unknown."""
    host, port = settings.kubernetes_service_host, settings.kubernetes_service_port
    if not host:
        raise KubeconfigError("KUBERNETES_SERVICE_HOST not set. Is this not running within a pod?")
    if not port:
        raise KubeconfigError("KUBERNETES_SERVICE_PORT not set. Is this not running within a pod?")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    cluster: dict[str, Any] = {"server": f"{settings.kubernetes_service_protocol}://{host}:{port}"}
    if settings.skip_tls_verify:
        cluster["insecure-skip-tls-verify"] = True
    else:
        cluster["certificate-authority-data"] = base64.b64encode(_read(settings.ca_file, "CA")).decode()
    token = _read(settings.service_account_dir / "token", "service account token").decode().strip()
    return {
        "apiVersion": "v1",
        "clusters": [{"cluster": cluster, "name": CLUSTER}],
        "contexts": [{"context": {"cluster": CLUSTER, "user": USER}, "name": CONTEXT}],
        "current-context": CONTEXT,
        "kind": "Config",
        "users": [{"name": USER, "user": {"token": token}}],
    }


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise KubeconfigError(f"cannot read the {what} {path}: {err.strerror}") from None


def render(document: dict[str, Any]) -> str:
    """JSON, keys sorted: valid YAML, so kubectl and client-go read it as they read Istio's YAML file,
    while the plugin, exec'd per pod, parses it without importing a YAML parser (docs/performance.md)."""
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def redacted(document: dict[str, Any]) -> dict[str, Any]:
    """The document with the token replaced: the only form that may be logged."""
    safe = copy.deepcopy(document)
    for user in safe.get("users", []):
        if "token" in user.get("user", {}):
            user["user"]["token"] = REDACTED
    return safe


def write(settings: InstallSettings) -> dict[str, Any]:
    """Write the kubeconfig atomically with its mode; returns the document (log it only via :func:`redacted`)."""
    document = build(settings)
    settings.cni_agent_run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(settings.kubeconfig_path, render(document), settings.kubeconfig_mode)
    return document
