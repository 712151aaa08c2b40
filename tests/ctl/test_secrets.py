"""``proxy-config secret``: istioctl's table and JSON (golden strings), our validity and chain checks, the diff."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from istio_agent.ctl import secrets, secretsview
from istio_agent.ctl.secrets import SecretsError, agent_items, check_files, diff, envoy_items, mismatches
from istio_agent.pem import CertificateSummary
from tests.ctl.secretdumps import Issued, cert, dump, root_secret, spiffe_secret, tls_secret, when

# Istio's golden outputs, byte for byte (trailing spaces included), from Istio 1.28.10 (ff49c188):
# istioctl/pkg/writer/envoy/configdump/testdata/secret/istio/output (blob 8d4bb70b0ccb52a100c5663c68acda8bee25cfa5)
# and .../secret/spire/output (blob 0c5c5baa95b3984c33ab7875e51ea1b7c12e9d97).
TESTDATA = Path(__file__).parent / "testdata"
ISTIO_GOLDEN = (TESTDATA / "secret-istio.txt").read_text()

SPIRE_GOLDEN = (TESTDATA / "secret-spire.txt").read_text()

NOW = when("2024-12-01T00:00:00Z")


@pytest.fixture(scope="module")
def istio_root() -> Issued:
    return cert(0x193A543FE2B0D9CD4847675394DFC54, "2023-05-05T03:41:33Z", "2033-05-02T03:41:33Z", ca=True)


@pytest.fixture(scope="module")
def istio_dump(istio_root: Issued) -> dict:
    leaf = cert(
        0x6FBEE254C22900615CB1F74E3D2F1713,
        "2023-05-15T01:30:52Z",
        "2023-05-16T01:32:52Z",
        issuer=istio_root,
        uri="spiffe://cluster.local/ns/default/sa/sleep",
    )
    return dump(
        active=[tls_secret("default", leaf.pem + istio_root.pem), root_secret("ROOTCA", istio_root.pem)],
        warming=[{"@type": "x", "name": "configmap://some/thing"}],
    )


def section(config_dump: dict) -> dict:
    return secrets.secrets_dump(config_dump, "test")


def table(config_dump: dict, now: datetime = NOW, verbose: bool = False) -> str:
    return secretsview.summary_table(envoy_items(section(config_dump), now), now=now, verbose=verbose)


def test_summary_is_istioctls_table(istio_dump: dict) -> None:
    assert table(istio_dump) == ISTIO_GOLDEN


def test_spire_summary_has_one_row_per_trust_domain_and_the_trust_domain_column() -> None:
    east = cert(
        0x529CBBAF623611D057B517D4FFE341E4E8035037, "2024-10-25T13:23:05Z", "2034-10-23T13:23:05Z", ca=True
    )
    west = cert(
        0x6726E5FAD145F8CA9A711F0550297CED839EE37F, "2024-10-25T13:23:05Z", "2034-10-23T13:23:05Z", ca=True
    )
    leaf = cert(
        0xCD4902E499169B11EC171DAD1668ADBB,
        "2024-10-27T21:44:27Z",
        "2024-10-27T22:44:37Z",
        issuer=east,
        uri="spiffe://east.local/ns/default/sa/app",
    )
    spire = dump(
        active=[
            tls_secret("default", leaf.pem),
            spiffe_secret("ROOTCA", {"east.local": east.pem, "west.local": west.pem}),
        ]
    )
    assert table(spire) == SPIRE_GOLDEN


def test_expired_and_not_yet_valid_certificates_are_not_valid(istio_root: Issued) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    fmt = "%Y-%m-%dT%H:%M:%SZ"

    def leaf(start: timedelta, end: timedelta) -> bytes:
        return cert(7, (now + start).strftime(fmt), (now + end).strftime(fmt), issuer=istio_root).pem

    config = dump(
        active=[
            tls_secret("default", leaf(-timedelta(hours=1), timedelta(hours=23, minutes=4))),
            tls_secret("expired", leaf(-timedelta(hours=2), -timedelta(minutes=3, seconds=12))),
            tls_secret("future", leaf(timedelta(minutes=5), timedelta(hours=2))),
            root_secret("ROOTCA", istio_root.pem),
        ]
    )
    items = {item.name: item for item in envoy_items(section(config), now)}
    assert items["default"].valid and items["default"].chain_verified is True
    assert not items["expired"].valid and items["expired"].problems == ["certificate 7 expired 3m12s ago"]
    assert not items["future"].valid and "not valid before" in items["future"].problems[0]
    assert items["expired"].seconds_to_expiry == -192
    wide = secretsview.summary_table(list(items.values()), now=now, verbose=True).splitlines()
    assert wide[0].split()[-2:] == ["EXPIRES", "CHAIN"]
    assert "in 23h4m" in wide[1] and wide[1].endswith("verified")
    assert "expired 3m12s ago" in wide[2]
    assert "valid in 5m" in wide[3]


def test_a_chain_that_does_not_lead_to_its_trust_bundle_is_reported_but_valid_cert_is_istioctls(
    istio_root: Issued,
) -> None:
    other_root = cert(99, "2023-01-01T00:00:00Z", "2033-01-01T00:00:00Z", ca=True, name="other root")
    leaf = cert(5, "2024-11-30T00:00:00Z", "2024-12-02T00:00:00Z", issuer=other_root, name="leaf")
    config = dump(
        active=[tls_secret("default", leaf.pem + other_root.pem), root_secret("ROOTCA", istio_root.pem)]
    )
    (item, root) = envoy_items(section(config), NOW)
    assert item.chain_verified is False and item.valid  # VALID CERT: the dates, as istioctl
    assert item.problems == [
        "chain does not verify against ROOTCA: no certificate of the trust bundle issued "
        "'O=other root' (its issuer is 'O=other root')"
    ]
    assert root.valid and root.chain_verified is None
    row = secretsview.summary_table([item], now=NOW, verbose=True).splitlines()[1]
    assert row.endswith("NOT VERIFIED") and " true " in row


def test_a_gateway_certificate_is_checked_against_its_own_ca_never_the_mesh_root(istio_root: Issued) -> None:
    public_root = cert(70, "2023-01-01T00:00:00Z", "2033-01-01T00:00:00Z", ca=True, name="public root")
    gateway = cert(71, "2024-11-30T00:00:00Z", "2024-12-02T00:00:00Z", issuer=public_root, name="gw")
    client_ca = cert(72, "2023-01-01T00:00:00Z", "2033-01-01T00:00:00Z", ca=True, name="client ca")
    config = dump(
        active=[
            tls_secret("kubernetes://public-gw", gateway.pem),  # a public CA's: no bundle of its own
            tls_secret("kubernetes://mtls-gw", gateway.pem),
            root_secret("kubernetes://mtls-gw-cacert", client_ca.pem),  # its CA is another one
            root_secret("ROOTCA", istio_root.pem),
        ]
    )
    items = {item.name: item for item in envoy_items(section(config), NOW)}
    public = items["kubernetes://public-gw"]
    assert public.valid and public.chain_verified is None and public.problems == []
    mtls = items["kubernetes://mtls-gw"]
    assert mtls.valid and mtls.chain_verified is False
    assert mtls.problems[0].startswith("chain does not verify against kubernetes://mtls-gw-cacert: ")
    assert secrets.trust_bundle_names("file-cert:/c~/k", {"file-root:/r": 1, "ROOTCA": 1}) == ["file-root:/r"]


def test_a_chain_through_an_intermediate_verifies(istio_root: Issued) -> None:
    intermediate = cert(
        11, "2024-01-01T00:00:00Z", "2025-01-01T00:00:00Z", ca=True, issuer=istio_root, name="int"
    )
    leaf = cert(12, "2024-11-30T00:00:00Z", "2024-12-02T00:00:00Z", issuer=intermediate, name="leaf")
    config = dump(
        active=[tls_secret("default", leaf.pem + intermediate.pem), root_secret("ROOTCA", istio_root.pem)]
    )
    assert envoy_items(section(config), NOW)[0].chain_verified is True
    # an expired intermediate breaks the chain even though the leaf is current
    later = when("2025-02-01T00:00:00Z")
    leaf2 = cert(13, "2025-01-30T00:00:00Z", "2025-02-02T00:00:00Z", issuer=intermediate, name="leaf")
    config = dump(
        active=[tls_secret("default", leaf2.pem + intermediate.pem), root_secret("ROOTCA", istio_root.pem)]
    )
    (item, _) = envoy_items(section(config), later)
    assert item.chain_verified is False and "'O=int' is not valid now" in item.problems[0]


def test_without_a_trust_bundle_the_chain_is_not_checked(istio_root: Issued) -> None:
    leaf = cert(5, "2024-11-30T00:00:00Z", "2024-12-02T00:00:00Z", issuer=istio_root)
    (item,) = envoy_items(section(dump(active=[tls_secret("default", leaf.pem)])), NOW)
    assert item.valid and item.chain_verified is None
    assert item.problems == []  # nothing to check it against is not a fault of the certificate


def test_no_secrets_is_an_empty_table_not_a_crash() -> None:
    empty = section(dump())
    assert envoy_items(empty, NOW) == []
    assert secretsview.summary_table([], now=NOW) == "No secret items to show.\n"
    assert not secrets.has_active_or_warming(empty)


def test_undecodable_data_is_an_invalid_item_with_a_reason() -> None:
    broken = {
        "@type": "x",
        "name": "default",
        "tls_certificate": {"certificate_chain": {"inline_bytes": "!!"}},
    }
    junk = tls_secret("junk", b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    items = envoy_items(section(dump(active=[broken, junk])), NOW)
    assert [(i.name, i.valid, i.serial_number) for i in items] == [
        ("default", False, ""),
        ("junk", False, ""),
    ]
    assert items[0].problems == ["inline_bytes is not base64"]
    assert items[1].problems[0].startswith("cannot parse its certificates: certificate 0:")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "dump.json is not an Envoy config dump: not JSON"),
        ('{"foo": 1}', 'dump.json is not an Envoy config dump: no "configs" list at the top'),
        ("[1, 2]", 'dump.json is not an Envoy config dump: no "configs" list at the top'),
    ],
)
def test_a_file_that_is_not_a_config_dump_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "dump.json"
    path.write_text(text)
    with pytest.raises(SecretsError, match="^" + str(tmp_path).replace("/", "/") + "/" + message):
        secrets.read_dump_file(str(path))


def test_missing_file_and_missing_section(tmp_path: Path) -> None:
    with pytest.raises(SecretsError, match=r"open .*/nope.json: no such file or directory"):
        secrets.read_dump_file(str(tmp_path / "nope.json"))
    with pytest.raises(
        SecretsError, match="config dump has no configuration type " + secrets.SECRETS_DUMP_TYPE
    ):
        secrets.secrets_dump(
            {"configs": [{"@type": "type.googleapis.com/envoy.admin.v3.ClustersConfigDump"}]}, "f"
        )


def test_items_json_is_istioctls_secret_item_shape(istio_dump: dict, istio_root: Issued) -> None:
    items = envoy_items(section(istio_dump), NOW)
    text = secretsview.items_json(items)
    assert text.startswith('[\n {\n  "resource_name": "configmap://some/thing",\n  "cert": "",\n')
    assert not text.endswith("\n")  # Go's MarshalIndent
    decoded = json.loads(text)
    assert list(decoded[1])[:11] == [
        "resource_name",
        "cert",
        "source",
        "destination",
        "state",
        "cert_valid",
        "serial_number",
        "not_after",
        "not_before",
        "type",
        "trust_domain",
    ]
    assert decoded[2]["cert"] == istio_root.pem.decode()
    assert decoded[1]["trust_domain"] == "cluster.local" and decoded[2]["trust_domain"] == ""
    assert decoded[1]["chain_verified"] is True and decoded[1]["cert_valid"] is False  # expired by NOW
    assert secretsview.go_json([{"a": "<&>"}]) == '[\n {\n  "a": "\\u003c\\u0026\\u003e"\n }\n]'


def test_json_and_yaml_output_the_secrets_config_dump(istio_dump: dict) -> None:
    # as istioctl's protomarshal.ToJSONWithIndent: jsonpb's lowerCamel names, no @type at the top
    text = secretsview.dump_json(section(istio_dump))
    assert text.startswith('{\n    "dynamicActiveSecrets": [\n        {\n            "name": "default",\n')
    decoded = json.loads(text)
    assert [s["name"] for s in decoded["dynamicActiveSecrets"]] == [
        s["name"] for s in section(istio_dump)["dynamic_active_secrets"]
    ]
    assert "dynamicActiveSecrets:\n" in secretsview.dump_yaml(section(istio_dump))


# -- the comparison -------------------------------------------------------------------------------------
def agent_view(held: dict[str, bytes], files: list[dict] = ()) -> dict:  # type: ignore[assignment]
    from istio_agent.pem import parse_certificates

    return {
        "secrets": [
            {
                "resource_name": name,
                "kind": "root" if name == "ROOTCA" else "cert_chain",
                "certificates": [CertificateSummary.of(c).as_json() for c in parse_certificates(data)],
            }
            for name, data in held.items()
        ],
        "files": list(files),
    }


def file_entry(name: str, path: str, data: bytes) -> dict:
    return {
        "resource_name": name,
        "path": path,
        "md5": "m",
        "sha256": "s",
        **agent_view({name: data})["secrets"][0],
    }


def test_diff_when_envoy_holds_what_the_agent_holds(istio_root: Issued) -> None:
    leaf = cert(0x1234, "2024-11-30T00:00:00Z", "2024-12-02T00:00:00Z", issuer=istio_root)
    chain = leaf.pem + istio_root.pem
    proxy = envoy_items(
        section(dump(active=[tls_secret("default", chain), root_secret("ROOTCA", istio_root.pem)])), NOW
    )
    agent = agent_items(agent_view({"default": chain, "ROOTCA": istio_root.pem}), "127.0.0.1:15020", NOW)
    rows = diff(proxy, agent)
    assert mismatches(rows) == []
    assert secretsview.diff_table(rows, now=NOW) == (
        "RESOURCE NAME     TYPE           VALID CERT     NODE AGENT          PROXY      SERIAL NUMBER                       "
        "NOT AFTER                NOT BEFORE\n"
        "default           Cert Chain     true           127.0.0.1:15020     ACTIVE     1234                                "
        "2024-12-02T00:00:00Z     2024-11-30T00:00:00Z\n"
        "ROOTCA            CA             true           127.0.0.1:15020     ACTIVE     193a543fe2b0d9cd4847675394dfc54     "
        "2033-05-02T03:41:33Z     2023-05-05T03:41:33Z\n"
    )
    assert [row.agent for row in rows] == ["PRESENT", "PRESENT"]


def test_diff_shows_the_rotation_envoy_has_not_received(istio_root: Issued) -> None:
    old = cert(0xA1, "2024-11-30T00:00:00Z", "2024-12-01T06:00:00Z", issuer=istio_root).pem + istio_root.pem
    new = cert(0xB2, "2024-11-30T23:00:00Z", "2024-12-02T00:00:00Z", issuer=istio_root).pem + istio_root.pem
    proxy = envoy_items(
        section(dump(active=[tls_secret("default", old), root_secret("ROOTCA", istio_root.pem)])), NOW
    )
    view = agent_view({"default": new, "ROOTCA": istio_root.pem})
    rows = diff(proxy, agent_items(view, "agent", NOW))
    assert [(r.item.name, r.item.serial_number, r.agent, r.proxy) for r in rows] == [
        ("default", "b2", "PRESENT", ""),  # sorted by state: the agent's row has none
        ("default", "a1", "", "ACTIVE"),
        ("ROOTCA", "193a543fe2b0d9cd4847675394dfc54", "PRESENT", "ACTIVE"),
    ]
    assert mismatches(rows) == [
        "default: Envoy holds serial a1, the agent holds serial b2: Envoy has not received the agent's current secret"
    ]
    document = secretsview.diff_document(rows, [])
    assert document["secrets"][0]["agent"] == "PRESENT" and document["secrets"][0]["proxy"] == ""
    assert secretsview.diff_table([], now=NOW) == "No secrets found to diff.\n"


def test_files_on_disk_are_compared_with_what_envoy_loaded(istio_root: Issued) -> None:
    chain = cert(0xC3, "2024-11-30T00:00:00Z", "2024-12-02T00:00:00Z", issuer=istio_root).pem + istio_root.pem
    stale = cert(0xD4, "2024-11-30T00:00:00Z", "2024-12-02T00:00:00Z", issuer=istio_root).pem + istio_root.pem
    other_root = cert(77, "2023-01-01T00:00:00Z", "2033-01-01T00:00:00Z", ca=True)
    proxy = envoy_items(
        section(dump(active=[tls_secret("default", chain), root_secret("ROOTCA", istio_root.pem)])), NOW
    )
    files = [
        file_entry("default", "/out/cert-chain.pem", chain),
        file_entry("default", "/mnt/cert-chain.pem", stale),
        file_entry("ROOTCA", "/out/root-cert.pem", istio_root.pem),
        file_entry("ROOTCA", "/old/root-cert.pem", other_root.pem),
        file_entry("file-cert:/a~/b", "/a", chain),
        {"resource_name": "ROOTCA", "path": "/gone/root-cert.pem", "error": "no such file or directory"},
    ]
    checks = check_files({"secrets": [], "files": files}, proxy)
    assert [(c.path, c.envoy, c.serial_number) for c in checks] == [
        ("/out/cert-chain.pem", "SAME", "c3"),
        ("/mnt/cert-chain.pem", "DIFFERENT", "d4"),
        ("/out/root-cert.pem", "SAME", "193a543fe2b0d9cd4847675394dfc54"),
        ("/old/root-cert.pem", "DIFFERENT", "4d"),
        ("/a", "NOT IN ENVOY", "c3"),
        ("/gone/root-cert.pem", "ERROR", ""),
    ]
    text = secretsview.files_table(checks).splitlines()
    assert text[0].split() == ["FILE", "RESOURCE", "NAME", "SERIAL", "NUMBER", "MD5", "ENVOY"]
    assert text[1].split() == ["/out/cert-chain.pem", "default", "c3", "m", "SAME"]
    assert secretsview.files_table([]) == ""


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (83040, "in 23h4m"),
        (-192, "3m12s ago"),
        (5, "in 5s"),
        (0, "0s ago"),
        (90061, "in 1d1h"),
        (3600, "in 1h"),
    ],
)
def test_relative(seconds: int, text: str) -> None:
    assert secrets.relative(NOW + timedelta(seconds=seconds), NOW) == text
