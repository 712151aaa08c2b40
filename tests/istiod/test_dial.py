"""The credential/dial layer to istiod shared by the CA client and the xDS upstream dialer.

The rules both clients follow are tested here, once: endpoints from settings, channel settings,
headers and the token, the root bundle, the client certificate. The clients' own tests dial real
gRPC servers with them.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509

from istio_agent.config import ConfigError, SecuritySettings, XdsSettings
from istio_agent.istiod import dial
from istio_agent.istiod.dial import (
    ClientCertFiles,
    CredentialError,
    DialMaterial,
    IstiodCredentials,
    IstiodEndpoint,
)
from istio_agent.istiod.tokens import FileTokenSource, StaticTokenSource, TokenSource
from istio_agent.rpc.channel import Channel
from tests.security.certs import MeshCA, key_to_pem, make_ca, new_key, to_pem

ISTIOD = "istiod.istio-system.svc"


@pytest.fixture
def pki(tmp_path: Path) -> MeshCA:
    return MeshCA.on_disk(tmp_path)


def client_files(pki: MeshCA, directory: Path, *, not_after: datetime | None = None) -> ClientCertFiles:
    return ClientCertFiles(*pki.client_pair(directory, not_after=not_after))


def tls(root: Path | None, **changes: object) -> IstiodEndpoint:
    fields: dict[str, object] = {
        "purpose": "XDS",
        "address": "istiod:15012",
        "plaintext": False,
        "root_cert": root,
        "server_name": ISTIOD,
    }
    fields.update(changes)
    return IstiodEndpoint(**fields)  # type: ignore[arg-type]


def plaintext(**changes: object) -> IstiodEndpoint:
    return IstiodEndpoint(**{"purpose": "XDS", "address": "istiod:15010", "plaintext": True, **changes})  # type: ignore[arg-type]


def credentials(
    endpoint: IstiodEndpoint, token: TokenSource | None = None, **kwargs: object
) -> IstiodCredentials:
    return IstiodCredentials(endpoint, token, **kwargs)  # type: ignore[arg-type]


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# -- endpoints from settings ------------------------------------------------------------------------
def test_ca_endpoint_follows_the_security_settings(tmp_path: Path) -> None:
    root = tmp_path / "var/run/secrets/istio/root-cert.pem"
    root.parent.mkdir(parents=True)
    root.write_text("x")
    settings = SecuritySettings(
        workdir=tmp_path,
        ca_addr="istiod.istio-system.svc:15012",
        ca_addr_defaulted=False,
        cluster_id="c1",
        ca_headers={"foo": "bar"},
        cert_signer="signer",
    )
    assert IstiodEndpoint.for_ca(settings) == IstiodEndpoint(
        purpose="CA",
        address="istiod.istio-system.svc:15012",
        plaintext=False,
        root_cert=root,
        server_name="istiod.istio-system.svc",
        client_cert=None,
        cluster_id="c1",
        headers={"foo": "bar"},
        keepalive_time=timedelta(seconds=30),
        keepalive_timeout=timedelta(seconds=10),
    )


def test_ca_endpoint_with_prov_cert_brings_its_root_and_client_certificate(tmp_path: Path) -> None:
    prov = tmp_path / "prov"
    settings = SecuritySettings(workdir=tmp_path, ca_addr="ca:15012", ca_addr_defaulted=False, prov_cert=prov)
    endpoint = IstiodEndpoint.for_ca(settings)
    assert endpoint.client_cert == ClientCertFiles(prov / "cert-chain.pem", prov / "key.pem")
    assert endpoint.root_cert == prov / "root-cert.pem"  # checked when dialling, as in Istio


def test_ca_endpoint_plaintext_needs_no_root(tmp_path: Path) -> None:
    endpoint = IstiodEndpoint.for_ca(
        SecuritySettings(workdir=tmp_path, ca_addr="localhost:15010", ca_addr_defaulted=False)
    )
    assert endpoint.plaintext
    assert endpoint.root_cert is None


def test_ca_endpoint_missing_root_is_a_config_error(tmp_path: Path) -> None:
    settings = SecuritySettings(workdir=tmp_path, ca_addr="istiod:15012", ca_addr_defaulted=False)
    with pytest.raises(ConfigError, match="root CA file for CA does not exist"):
        IstiodEndpoint.for_ca(settings)


def test_ca_endpoint_system_root_uses_the_os_store(tmp_path: Path) -> None:
    settings = SecuritySettings(
        workdir=tmp_path, ca_addr="ca.example.com:443", ca_addr_defaulted=False, ca_root_ca="SYSTEM"
    )
    endpoint = IstiodEndpoint.for_ca(settings)
    assert endpoint.root_cert is None
    assert endpoint.server_name == "ca.example.com"


def test_xds_endpoint_follows_the_xds_settings(tmp_path: Path) -> None:
    settings = XdsSettings(
        socket_path=tmp_path / "XDS",
        discovery_address="10.0.0.1:15012",
        root_ca=tmp_path / "root.pem",
        server_name=ISTIOD,
        client_cert=tmp_path / "cert.pem",
        client_key=tmp_path / "key.pem",
        cluster_id="c2",
        headers={"x-a": "1"},
        keepalive_interval=timedelta(seconds=7),
        keepalive_timeout=timedelta(seconds=3),
    )
    assert IstiodEndpoint.for_xds(settings) == IstiodEndpoint(
        purpose="XDS",
        address="10.0.0.1:15012",
        plaintext=False,
        root_cert=tmp_path / "root.pem",
        server_name=ISTIOD,
        client_cert=ClientCertFiles(tmp_path / "cert.pem", tmp_path / "key.pem"),
        cluster_id="c2",
        headers={"x-a": "1"},
        keepalive_time=timedelta(seconds=7),
        keepalive_timeout=timedelta(seconds=3),
    )
    # Half a pair is no pair.
    half = XdsSettings(tmp_path / "XDS", "a:15012", client_cert=tmp_path / "cert.pem")
    assert IstiodEndpoint.for_xds(half).client_cert is None


# -- channels --------------------------------------------------------------------------------------
def test_channel_settings() -> None:
    settings = credentials(
        tls(None, keepalive_time=timedelta(seconds=7), keepalive_timeout=timedelta(seconds=3))
    ).channel_settings()
    assert settings == dial.ChannelSettings(keepalive_time=7.0, keepalive_timeout=3.0, server_name=ISTIOD)
    assert credentials(tls(None, server_name="")).channel_settings().server_name is None
    plain = credentials(plaintext(server_name=ISTIOD)).channel_settings()
    assert plain == dial.ChannelSettings(keepalive_time=30.0, keepalive_timeout=10.0, server_name=None)


async def test_channels_are_the_agents_own_and_connect_only_when_called(pki: MeshCA) -> None:
    plain = credentials(plaintext())
    secure = credentials(tls(pki.root))
    for channel in (plain.channel(plain.material()), secure.channel(secure.material())):
        assert isinstance(channel, Channel)
        assert channel._channel._protocol is None  # no dial until a call needs one
        channel.close()


async def test_channels_accept_responses_as_large_as_istios_clients_do(pki: MeshCA) -> None:
    """Istio's ClientOptions (pilot/pkg/grpc/grpc.go) lift gRPC's 4 MiB receive limit to MaxInt32
    for every channel to istiod: the CA client's as well as the xDS upstream's."""
    for creds in (credentials(plaintext()), credentials(tls(pki.root))):
        channel = creds.channel(creds.material())
        assert channel.max_receive_bytes == dial.MAX_RECEIVE_BYTES == 2**31 - 1
        channel.close()


async def test_a_client_certificate_replaced_after_it_was_read_is_left_out(
    tmp_path: Path, pki: MeshCA, caplog: pytest.LogCaptureFixture
) -> None:
    files = client_files(pki, tmp_path)
    creds = credentials(tls(pki.root, client_cert=files))
    material = creds.material()
    files.key.write_bytes(key_to_pem(new_key()))  # a rotation half written
    creds.channel(material).close()
    assert lines(caplog, "cannot load client certificate")


# -- headers and the token --------------------------------------------------------------------------
def test_metadata_has_cluster_id_headers_and_fresh_token(tmp_path: Path) -> None:
    token = tmp_path / "istio-token"
    token.write_text(" first-token\n")
    creds = credentials(plaintext(cluster_id="c1", headers={"x-a": "1"}), FileTokenSource(token))
    assert creds.metadata() == [("clusterid", "c1"), ("x-a", "1"), ("authorization", "Bearer first-token")]
    token.write_text("second-token")
    assert ("authorization", "Bearer second-token") in creds.metadata()


def test_cluster_id_header_is_sent_even_when_empty() -> None:
    assert credentials(plaintext()).metadata() == [("clusterid", "")]


def test_missing_token_warns_once_and_sends_no_header(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    creds = credentials(plaintext(), FileTokenSource(tmp_path / "absent"))
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        assert [name for name, _ in creds.metadata()] == ["clusterid"]
    assert lines(caplog, "absent") == [
        f"failed to fetch a token from token file {tmp_path / 'absent'}: No such file or directory; "
        "sending no token"
    ]


def test_token_problems_are_logged_in_the_scope_of_the_client_that_met_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One token source serves both clients, as in Istio; each says what it could not send under its
    own scope: the xDS proxy's under ``xdsproxy``, the CA client's under ``citadelclient``."""
    shared = FileTokenSource(tmp_path / "absent")
    caplog.set_level(logging.WARNING)
    credentials(plaintext(purpose="XDS"), shared).metadata()
    assert [r.name for r in caplog.records] == ["istio.xdsproxy"]
    credentials(plaintext(purpose="CA"), shared).metadata()
    assert [r.name for r in caplog.records] == ["istio.xdsproxy", "istio.citadelclient"]


def test_each_distinct_token_problem_is_logged_and_recovery_resets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "istio-token"
    creds = credentials(plaintext(), FileTokenSource(path))
    caplog.set_level(logging.WARNING)
    assert creds.token() == ""
    path.mkdir()  # a different problem: a directory where the token should be
    assert [creds.token(), creds.token()] == ["", ""]
    path.rmdir()
    path.write_text("secret-jwt-value")
    assert creds.token() == "secret-jwt-value"
    path.unlink()
    assert creds.token() == ""  # the first problem again, after a recovery: said again
    assert len(lines(caplog, "failed to fetch a token")) == 3
    assert "secret-jwt-value" not in caplog.text


@pytest.mark.parametrize("purpose", ["CA", "XDS"])
@pytest.mark.parametrize("value", ["secret-part\x01more", "secret part", "secret-\u00e9t\u00e9"])
def test_token_unfit_for_a_header_is_not_sent_nor_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, purpose: str, value: str
) -> None:
    """The one behaviour of both clients: such a token is left out (a client certificate may still
    authenticate the call), the token file is named once, the value never."""
    token = tmp_path / "istio-token"
    token.write_text(value)
    creds = credentials(plaintext(purpose=purpose), FileTokenSource(token))
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        assert [name for name, _ in creds.metadata()] == ["clusterid"]
    assert "secret" not in caplog.text
    assert len(lines(caplog, f"token file {token} holds characters not allowed in a header")) == 1
    token.write_text("fixed")
    assert ("authorization", "Bearer fixed") in creds.metadata()


class FailingTokenSource:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def token(self) -> str:
        raise self.error

    def __str__(self) -> str:
        return "the metadata server"


def test_token_that_cannot_be_fetched_is_not_sent_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    creds = credentials(plaintext(), FailingTokenSource(ConnectionRefusedError(111, "Connection refused")))
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        assert creds.token() == ""
    assert lines(caplog, "failed to fetch a token") == [
        "failed to fetch a token from the metadata server: Connection refused; sending no token"
    ]


def test_a_token_source_bug_surfaces() -> None:
    creds = credentials(plaintext(), FailingTokenSource(AttributeError("no such field")))
    with pytest.raises(AttributeError):
        creds.metadata()


def test_static_token_is_sent() -> None:
    assert credentials(plaintext(), StaticTokenSource("t")).metadata()[-1] == ("authorization", "Bearer t")


# -- the root bundle --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("purpose", "message"),
    [
        ("CA", r"^invalid config - istiod:15012 missing a root certificate .*absent\.pem$"),
        ("XDS", r"^root CA file for XDS does not exist .*absent\.pem$"),
    ],
)
def test_missing_root_is_worded_as_istio_words_it(tmp_path: Path, purpose: str, message: str) -> None:
    with pytest.raises(CredentialError, match=message):
        credentials(tls(tmp_path / "absent.pem", purpose=purpose)).material()


def test_unreadable_root_names_the_file(tmp_path: Path) -> None:
    root = tmp_path / "root-dir"
    root.mkdir()
    with pytest.raises(CredentialError, match=r"^cannot read root CA file for XDS .*root-dir: "):
        credentials(tls(root)).material()


@pytest.mark.parametrize("content", [b"", b"not a certificate\n", b"-----BEGIN CERTIFICATE-----\nAAAA\n"])
def test_root_file_without_certificates_is_a_clear_error(tmp_path: Path, content: bytes) -> None:
    root = tmp_path / "root-cert.pem"
    root.write_bytes(content)
    with pytest.raises(CredentialError, match=r"no PEM certificate found in .*root-cert\.pem"):
        credentials(tls(root)).material()


def test_root_is_read_at_each_use(pki: MeshCA, tmp_path: Path) -> None:
    creds = credentials(tls(pki.root))
    first = creds.material()
    rotated = make_ca("rotated-root")[1]
    pki.root.write_bytes(to_pem(rotated))
    assert creds.material() != first  # the CA client re-dials on this difference
    assert creds.material().root == to_pem(rotated)


def test_root_keeps_its_certificates_and_an_unchanged_file_is_parsed_once(
    pki: MeshCA, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(
        b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n" + to_pem(pki.ca)
    )
    creds = credentials(tls(bundle))
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        assert creds.material().root == to_pem(pki.ca)
    assert len(lines(caplog, "ignoring root certificate")) == 1


def test_no_root_configured_means_the_os_bundle(
    pki: MeshCA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dial, "os_ca_bundle", lambda: pki.root)
    assert credentials(tls(None)).material().root == to_pem(pki.ca)
    monkeypatch.setattr(dial, "os_ca_bundle", lambda: None)
    assert credentials(tls(None)).material().root is None  # gRPC's built-in roots


def test_plaintext_reads_no_files(tmp_path: Path) -> None:
    endpoint = plaintext(
        root_cert=tmp_path / "absent.pem",
        client_cert=ClientCertFiles(tmp_path / "absent-cert.pem", tmp_path / "absent-key.pem"),
    )
    assert credentials(endpoint).material() == DialMaterial()


# -- the client certificate -------------------------------------------------------------------------
def _spoil(problem: str, pki: MeshCA, directory: Path) -> ClientCertFiles:
    if problem == "expired":
        return client_files(pki, directory, not_after=datetime.now(UTC) - timedelta(hours=1))
    files = client_files(pki, directory)
    if problem == "garbage-cert":
        files.chain.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    elif problem == "garbage-key":
        files.key.write_bytes(b"garbage")
    elif problem == "wrong-key":
        files.key.write_bytes(key_to_pem(new_key()))
    elif problem == "missing":
        files.chain.unlink()
    elif problem == "unreadable":
        files.key.unlink()
        files.key.mkdir()
    return files


@pytest.mark.parametrize(
    "problem", ["expired", "garbage-cert", "garbage-key", "wrong-key", "missing", "unreadable"]
)
def test_unusable_client_cert_is_not_presented_and_logged_once(
    tmp_path: Path, pki: MeshCA, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    files = _spoil(problem, pki, tmp_path)
    creds = credentials(tls(pki.root, client_cert=files))
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        assert creds.material() == DialMaterial(root=to_pem(pki.ca), client_cert=None)
    (line,) = lines(caplog, "client certificate")
    assert line.endswith("connecting without one")
    assert "-----BEGIN" not in caplog.text  # no PEM text in the logs


async def test_unusable_client_cert_still_dials(tmp_path: Path, pki: MeshCA) -> None:
    creds = credentials(tls(pki.root, client_cert=_spoil("wrong-key", pki, tmp_path)))
    creds.channel(creds.material()).close()


def test_usable_client_cert_is_read_at_each_use(tmp_path: Path, pki: MeshCA) -> None:
    files = client_files(pki, tmp_path)
    creds = credentials(tls(pki.root, client_cert=files))
    assert creds.client_certificate() == (files.key.read_bytes(), files.chain.read_bytes())
    client_files(pki, tmp_path)  # re-provisioned in place
    assert creds.client_certificate() == (files.key.read_bytes(), files.chain.read_bytes())


def test_client_cert_expires_by_the_injected_clock(tmp_path: Path, pki: MeshCA) -> None:
    files = client_files(pki, tmp_path)
    not_after = x509.load_pem_x509_certificate(files.chain.read_bytes()).not_valid_after_utc
    endpoint = tls(pki.root, client_cert=files)
    assert (
        credentials(endpoint, now=lambda: not_after - timedelta(seconds=1)).client_certificate() is not None
    )
    assert credentials(endpoint, now=lambda: not_after + timedelta(seconds=1)).client_certificate() is None


def test_a_new_problem_is_logged_again_after_recovery(
    tmp_path: Path, pki: MeshCA, caplog: pytest.LogCaptureFixture
) -> None:
    files = client_files(pki, tmp_path)
    creds = credentials(tls(pki.root, client_cert=files))
    caplog.set_level(logging.DEBUG)
    good = files.key.read_bytes()
    files.key.write_bytes(key_to_pem(new_key()))
    assert creds.client_certificate() is None
    files.key.write_bytes(good)
    assert creds.client_certificate() is not None
    files.key.write_bytes(key_to_pem(new_key()))
    assert creds.client_certificate() is None
    assert len(lines(caplog, "ignoring client certificate")) == 2
