"""``proxy-config rootca-compare``: istioctl 1.28's ROOTCA extraction, comparison and messages.

istioctl (``istioctl/pkg/proxyconfig/proxyconfig.go``, ``rootCACompareConfigCmd`` and its helpers;
``istioctl/pkg/writer/envoy/configdump/configdump.go``, ``PrintPodRootCAFromDynamicSecretDump``;
``istioctl/pkg/util/configdump/secret.go``, ``GetRootCAFromSecretConfigDump``, all at ff49c188) reads
the active dynamic secret named ROOTCA, its validation context's trusted CA, and reports a match when
the two bundles share one certificate. The end-to-end tests run real Envoys that hold ROOTCA from
SDS (a file-based SDS source, so the secret is dynamic, as the agent's SDS makes it).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from istio_agent.ctl import rootca
from istio_agent.ctl.rootca import RootCAError, parse_pem_certs, root_ca, share_a_certificate
from tests.ctl.secretdumps import cert, dump, root_secret, spiffe_secret, tls_secret
from tests.ctl.test_envoylog import admin_envoy

SECRETS = "type.googleapis.com/envoy.admin.v3.SecretsConfigDump"


@pytest.fixture(scope="module")
def roots() -> dict[str, bytes]:
    return {
        name: cert(serial, "2024-01-01T00:00:00Z", "2034-01-01T00:00:00Z", ca=True, name=name).pem
        for name, serial in (("A", 0xA1), ("B", 0xB2))
    }


# -- extraction (istioctl's errors) ---------------------------------------------------------------------
def test_root_ca_is_the_trusted_ca_of_the_active_rootca_secret(roots: dict[str, bytes]) -> None:
    leaf = cert(7, "2024-01-01T00:00:00Z", "2025-01-01T00:00:00Z")
    config = dump(active=[tls_secret("default", leaf.pem), root_secret("ROOTCA", roots["A"] + roots["B"])])
    assert root_ca(config) == roots["A"] + roots["B"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"configs": [{"@type": "type.googleapis.com/envoy.admin.v3.BootstrapConfigDump"}]},
            f"sidecar doesn't support secrets: config dump has no configuration type {SECRETS}",
        ),
        (dump(), "cannot find ROOTCA from secret"),
        # Warming is not active: istioctl looks at dynamic_active_secrets only.
        (dump(warming=[root_secret("ROOTCA", b"x")]), "cannot find ROOTCA from secret"),
        (
            dump(active=[tls_secret("ROOTCA", b"x")]),
            "can not dump ROOTCA from secret: cannot find ROOTCA from secret config dump",
        ),
        (
            dump(active=[spiffe_secret("ROOTCA", {"cluster.local": b"x"})]),
            "can not dump ROOTCA from secret: cannot retrieve trustedCa from secret ROOTCA",
        ),
        (
            dump(
                active=[
                    {
                        "name": "ROOTCA",
                        "validation_context": {"trusted_ca": {"inline_string": "-----BEGIN"}},
                    }
                ]
            ),
            "can not dump ROOTCA from secret: cannot retrieve inlineBytes from trustCA section",
        ),
    ],
)
def test_extraction_errors_are_istioctls(config: dict[str, Any], message: str) -> None:
    with pytest.raises(RootCAError) as caught:
        root_ca(config)
    assert str(caught.value) == message


def test_static_secrets_do_not_count(roots: dict[str, bytes]) -> None:
    config = dump()
    config["configs"][1]["static_secrets"] = [{"name": "ROOTCA", "secret": root_secret("ROOTCA", roots["A"])}]
    with pytest.raises(RootCAError, match=r"^cannot find ROOTCA from secret$"):
        root_ca(config)


def test_undecodable_inline_bytes() -> None:
    config = dump(active=[root_secret("ROOTCA", b"")])
    config["configs"][1]["dynamic_active_secrets"][0]["secret"]["validation_context"]["trusted_ca"] = {
        "inline_bytes": "not base64!"
    }
    with pytest.raises(
        RootCAError, match=r"^can not dump ROOTCA from secret: failed to decode inlinebytes: "
    ):
        root_ca(config)


# -- comparison (istioctl's TestMatchRootCACerts cases) ------------------------------------------------
def test_comparison(roots: dict[str, bytes]) -> None:
    a, b = roots["A"], roots["B"]
    assert share_a_certificate(a, a) is True
    assert share_a_certificate(a, b) is False
    assert share_a_certificate(a + b, b) is True
    assert share_a_certificate(b, a + b) is True


def test_invalid_data_is_istioctls_error(roots: dict[str, bytes]) -> None:
    with pytest.raises(RootCAError) as caught:
        share_a_certificate(b"invalid data", roots["A"])
    assert str(caught.value) == "failed to parse certificates: invalid data"


def test_a_block_that_is_not_a_certificate(roots: dict[str, bytes]) -> None:
    broken = roots["A"].replace(b"\n", b"\n" + b"AAAA" * 16 + b"\n", 1)
    with pytest.raises(RootCAError, match=r"^failed to parse certificate: "):
        share_a_certificate(roots["B"], broken)


def test_parse_keeps_every_certificate(roots: dict[str, bytes]) -> None:
    assert len(parse_pem_certs(roots["A"] + roots["B"])) == 2


def test_messages() -> None:
    assert rootca.match_message("a:1", "b:2") == (
        "Both [a:1] and [b:2] have the identical ROOTCA, theoretically the connectivity between them is available"
    )
    assert rootca.mismatch_message("a:1", "b:2") == (
        "Both [a:1] and [b:2] have the non identical ROOTCA, "
        "theoretically the connectivity between them is unavailable"
    )


# -- real Envoys ----------------------------------------------------------------------------------------
def sds_envoy(stack: ExitStack, directory: Path, bundle: bytes) -> str:
    """A real Envoy whose ROOTCA comes from a file-based SDS source (a dynamic, active secret)."""
    name = f"sds-{len(list(directory.glob('sds-*')))}.json"
    sds = directory / name
    sds.write_text(
        json.dumps(
            {
                "version_info": "1",
                "resources": [
                    {
                        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
                        "name": "ROOTCA",
                        "validation_context": {
                            "trusted_ca": {"inline_bytes": base64.b64encode(bundle).decode()}
                        },
                    }
                ],
            }
        )
    )
    tls = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {
            "validation_context_sds_secret_config": {
                "name": "ROOTCA",
                "sds_config": {"path_config_source": {"path": str(sds)}, "resource_api_version": "V3"},
            }
        },
    }
    cluster = {
        "name": "mtls",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "mtls", "endpoints": []},
        "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": tls},
    }
    return stack.enter_context(admin_envoy(directory, static_resources={"clusters": [cluster]}))


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as envoys:
        yield envoys


def agentctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.agentctl", "proxy-config", "rootca-compare", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.e2e
def test_two_envoys_with_the_same_root(stack: ExitStack, short_tmp: Path, roots: dict[str, bytes]) -> None:
    one, two = sds_envoy(stack, short_tmp, roots["A"]), sds_envoy(stack, short_tmp, roots["A"])
    done = agentctl(one, two)
    assert done.returncode == 0, done.stderr
    # istioctl prints the report with cobra's Println, which writes to stderr.
    assert (done.stdout, done.stderr) == ("", rootca.match_message(one, two) + "\n")


@pytest.mark.e2e
def test_two_envoys_with_different_roots(stack: ExitStack, short_tmp: Path, roots: dict[str, bytes]) -> None:
    one, two = sds_envoy(stack, short_tmp, roots["A"]), sds_envoy(stack, short_tmp, roots["B"])
    done = agentctl(one, two)
    assert done.returncode == 1
    assert (done.stdout, done.stderr) == ("", f"Error: {rootca.mismatch_message(one, two)}\n")


@pytest.mark.e2e
def test_a_root_shared_within_a_bundle_matches(
    stack: ExitStack, short_tmp: Path, roots: dict[str, bytes]
) -> None:
    one = sds_envoy(stack, short_tmp, roots["A"] + roots["B"])
    two = sds_envoy(stack, short_tmp, roots["B"])
    done = agentctl(one, two)
    assert done.returncode == 0, done.stderr
    assert done.stderr == rootca.match_message(one, two) + "\n"


@pytest.mark.e2e
def test_an_envoy_without_rootca(stack: ExitStack, short_tmp: Path, roots: dict[str, bytes]) -> None:
    one = sds_envoy(stack, short_tmp, roots["A"])
    bare = stack.enter_context(admin_envoy(short_tmp))
    done = agentctl(one, bare)
    assert (done.returncode, done.stderr) == (1, "Error: cannot find ROOTCA from secret\n")


def test_two_targets_are_required() -> None:
    done = agentctl("127.0.0.1:15000")
    assert (done.returncode, done.stderr) == (1, "Error: rootca-compare requires 2 pods as an argument\n")
