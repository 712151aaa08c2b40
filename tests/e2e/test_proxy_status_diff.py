"""End to end: ``agentctl proxy-status PROXY`` compares what the local control plane would send a
proxy with what its real Envoy holds, as istioctl 1.28 does.

Two workloads run ``pilot-agent proxy`` with a real Envoy. Asked over TLS with a token, the control
plane's ``istio.io/debug/config_dump`` for ``a.default`` and a's Envoy (its admin port) match in all
three sections; a saved dump edited to drop a cluster prints istioctl's diff of it; an unknown proxy is
istioctl's error; through the agent's tap the same comparison is made.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from istio_agent.controlplane.tokens import mint_token
from istio_agent.ctl.local import wait_until
from istio_agent.ctl.localmesh import LocalMesh, admin_json
from tests.e2e.test_proxy_status import mesh  # noqa: F401  (the two-workload mesh fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def proxy_status(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.agentctl", "proxy-status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        input=stdin,
    )


def tls_flags(local: LocalMesh, tmp: Path) -> tuple[str, ...]:
    token = tmp / "istioctl-token"
    token.write_text(mint_token(local.state_dir, "istio-system", "default"))
    root = str(local.state_dir / "root-cert.pem")
    return ("--xds-address", local.discovery_address, "--root-cert", root, "--token", str(token))


MATCH = re.compile(
    r"\AClusters Match\nListeners Match\nRoutes Match( \(RDS last loaded at \w{3}, \d\d \w{3} \d{4} "
    r"\d\d:\d\d:\d\d \S+\))?\n\Z"
)


def test_proxy_status_of_a_proxy_matches_then_shows_a_dropped_cluster(
    mesh: LocalMesh,  # noqa: F811
    short_tmp: Path,
) -> None:
    a = mesh.workload("a")
    tls = tls_flags(mesh, short_tmp)
    admin = ("--proxy-admin-address", f"127.0.0.1:{a.ports['admin']}")
    seen: dict[str, subprocess.CompletedProcess[str]] = {}

    def matches() -> bool:  # Envoy applies a push a moment after the control plane has it
        seen["done"] = proxy_status("a.default", *tls, *admin)
        return seen["done"].returncode == 0 and bool(MATCH.match(seen["done"].stdout))

    wait_until(matches, 30, "a's Envoy to hold what the control plane would send")
    assert seen["done"].stderr == ""

    # The same with the namespace from -n, and through a's own agent's tap.
    assert MATCH.match(proxy_status("a", "-n", "default", *tls, *admin).stdout)
    via = proxy_status(
        "a.default", "--xds-via-agents", f"--agent-address=a.default=127.0.0.1:{a.ports['tap']}", *admin
    )
    assert via.returncode == 0 and MATCH.match(via.stdout), via.stdout + via.stderr

    # A saved dump with one cluster dropped: the clusters differ, by that cluster's lines only.
    saved = admin_json(a.ports["admin"], "/config_dump")
    section = next(c for c in saved["configs"] if c["@type"].endswith("ClustersConfigDump"))
    dropped = section["dynamic_active_clusters"].pop(0)["cluster"]["name"]
    edited = short_tmp / "edited.json"
    edited.write_text(json.dumps(saved))
    diff = proxy_status("a.default", *tls, "--file", str(edited))
    assert diff.returncode == 0, diff.stderr
    lines = diff.stdout.splitlines()
    assert lines[:3] == ["Clusters Don't Match", "--- Istiod Clusters", "+++ Envoy Clusters"], diff.stdout
    assert re.fullmatch(r"@@ -\d+(,\d+)? \+\d+(,\d+)? @@", lines[3])
    changed = [line for line in lines if line[:1] in ("+", "-") and line[:3] not in ("---", "+++")]
    assert changed and all(line.startswith("-") for line in changed), diff.stdout
    assert f'-                "name": "{dropped}",' in changed
    assert "Listeners Match" in lines  # listeners and routes were not edited
    assert any(line.startswith("Routes Match") for line in lines)

    # From stdin the same.
    assert proxy_status("a.default", *tls, "--file", "-", stdin=json.dumps(saved)).stdout == diff.stdout


def test_proxy_status_of_an_unknown_proxy_is_istioctls_error(
    mesh: LocalMesh,  # noqa: F811
    short_tmp: Path,
) -> None:
    a = mesh.workload("a")
    tls = tls_flags(mesh, short_tmp)
    done = proxy_status("nobody.default", *tls, "--proxy-admin-address", f"127.0.0.1:{a.ports['admin']}")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == "Error: unable to find config dump in Istiod responses\n"

    # As istiod: the plaintext port answers no debug question.
    plain = proxy_status(
        "a.default",
        "--xds-address",
        f"127.0.0.1:{mesh.port}",
        "--plaintext",
        "--proxy-admin-address",
        f"127.0.0.1:{a.ports['admin']}",
    )
    assert plain.returncode == 1
    assert "UNAUTHENTICATED: authentication required" in plain.stderr
