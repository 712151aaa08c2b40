"""``agentctl proxy-config secret``: the secrets an Envoy holds, checked, and compared with its agent's.

Items are built as istioctl builds them (``istioctl/pkg/util/configdump/secret.go``, and the
comparison of ``istioctl/pkg/writer/compare/sds``): warming secrets first, then active ones; the
certificate data is a TLS certificate's chain, else a validation context's trusted CA, else one
item per trust domain of a SPIFFE validator. The metadata (type, serial, validity) comes from the
first certificate. Beyond istioctl (docs/proxy-config-secret.md):

* a certificate chain is also checked against the trust bundle the same Envoy holds for it
  (:func:`trust_bundle_names`: ``ROOTCA`` for the workload's, ``X-cacert`` for a gateway's ``X``),
  reported as its own column and field; VALID CERT stays istioctl's (the dates only), so a gateway
  certificate from a public CA is not turned invalid;
* the comparison is with the agent's own ``/debug/secrets`` (istioctl lost its agent side in 1.7)
  and with the certificate files on disk, by certificate fingerprints.

Rendering is in ``ctl/secretsview.py``; this module has the data and the rules.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from istio_agent.pem import CertificateSummary, PemError, chain_problem, parse_certificates, rfc3339

SECRETS_DUMP_TYPE = "type.googleapis.com/envoy.admin.v3.SecretsConfigDump"
SPIFFE_VALIDATOR_TYPE = (
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.SPIFFECertValidatorConfig"
)
CONFIG_DUMP_TARGET = "/config_dump?mask=dynamic_active_secrets,dynamic_warming_secrets,static_secrets"
"""Only the secrets, as istioctl asks (it leaves out static secrets, which we list too)."""
AGENT_SECRETS_TARGET = "/debug/secrets"
DEFAULT_AGENT = "127.0.0.1:15020"
MAX_DUMP = 64 * 1024 * 1024
WORKLOAD_SECRET = "default"
ROOT_SECRET = "ROOTCA"
CA_SECRET_SUFFIX = "-cacert"
FILE_CERT_PREFIX = "file-cert:"
FILE_ROOT_PREFIX = "file-root:"
"""Istio's SDS resource names (``pkg/security``: WorkloadKeyCertResourceName, RootCertReqResourceName,
SdsCaSuffix, the file-mounted prefixes)."""
PRESENT = "PRESENT"


class SecretsError(Exception):
    """The secrets could not be read (unreachable address, not a config dump, ...); the message says which."""


@dataclass
class SecretItem:
    """istioctl's SecretItem (its JSON field names in ``as_json``), plus our checks."""

    name: str
    data: str = ""
    """The PEM text of the chain or bundle (empty when Envoy has none, or for the agent's side)."""
    source: str = ""
    """Who holds it besides Envoy: the agent's address after ``diff`` (the NODE AGENT column)."""
    destination: str = ""
    state: str = ""
    """Envoy's: ``WARMING``, ``ACTIVE`` or ``STATIC``; empty for the agent's side."""
    trust_domain: str = ""
    valid: bool = False
    """VALID CERT, as istioctl's: the first certificate valid now (its dates only)."""
    serial_number: str = ""
    not_after: str = ""
    not_before: str = ""
    type: str = ""
    """``CA`` or ``Cert Chain``, from the first certificate's basic constraints."""
    is_bundle: bool = False
    """A validation context (trust bundle), as opposed to a certificate chain."""
    certificates: tuple[CertificateSummary, ...] = ()
    seconds_to_expiry: int | None = None
    chain_verified: bool | None = None
    """Whether the chain leads to the trust bundle Envoy holds for it (:func:`trust_bundle_names`);
    None when not checked (a bundle, no data, no bundle of its own)."""
    problems: list[str] = field(default_factory=list)

    @property
    def fingerprints(self) -> tuple[str, ...]:
        return tuple(c.sha256 for c in self.certificates)

    def as_json(self) -> dict[str, Any]:
        """istioctl's SecretItem JSON (``SecretMeta`` flattened in), then our fields."""
        return {
            "resource_name": self.name,
            "cert": self.data,
            "source": self.source,
            "destination": self.destination,
            "state": self.state,
            "cert_valid": self.valid,
            "serial_number": self.serial_number,
            "not_after": self.not_after,
            "not_before": self.not_before,
            "type": self.type,
            "trust_domain": self.trust_domain,
            "chain_verified": self.chain_verified,
            "seconds_to_expiry": self.seconds_to_expiry,
            "problems": self.problems,
        }


@dataclass
class SecretItemDiff:
    """istioctl's SecretItemDiff: an item, whether the agent holds it, and Envoy's state of it."""

    agent: str
    proxy: str
    item: SecretItem

    def as_json(self) -> dict[str, Any]:
        return {"agent": self.agent, "proxy": self.proxy, **self.item.as_json()}


@dataclass(frozen=True)
class FileCheck:
    """A certificate file the agent reads or writes, against what Envoy loaded for its resource."""

    path: str
    resource_name: str
    envoy: str
    """``SAME``, ``DIFFERENT``, ``NOT IN ENVOY`` or ``ERROR``."""
    md5: str = ""
    """Of the file's bytes, to compare with an ``md5sum`` taken elsewhere."""
    sha256: str = ""
    serial_number: str = ""
    """Of the file's first certificate."""
    error: str = ""

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- reading -------------------------------------------------------------------------------------------
def _json_with_list(text: str | bytes, key: str, what: str) -> dict[str, Any]:
    """A JSON object with a list under ``key``; otherwise SecretsError saying ``what`` it is not."""
    from istio_agent.ctl.configdump.source import read_json

    try:
        document = read_json(text)
    except ValueError as err:  # JSONDecodeError is one
        raise SecretsError(f"{what}: not JSON ({err})") from None
    if not isinstance(document, dict) or not isinstance(document.get(key), list):
        raise SecretsError(f'{what}: no "{key}" list at the top')
    return document


def parse_dump(text: str | bytes, source: str) -> dict[str, Any]:
    """An Envoy config dump (JSON with a ``configs`` list); SecretsError naming ``source`` otherwise."""
    return _json_with_list(text, "configs", f"{source} is not an Envoy config dump")


SECRET_LISTS = ("dynamic_active_secrets", "dynamic_warming_secrets", "static_secrets")


def secrets_dump(dump: dict[str, Any], source: str) -> dict[str, Any]:
    """The SecretsConfigDump section, the last as every config-dump view takes it (istioctl's
    getSection; its error when there is none); SecretsError when a secret list is not a list."""
    from istio_agent.ctl.configdump.source import ConfigDumpError, Dump

    try:
        section = Dump(dump).section("SecretsConfigDump")
    except ConfigDumpError as err:
        raise SecretsError(f"{source}: {err}") from None
    for key in SECRET_LISTS:
        if not isinstance(section.get(key) or [], list):
            raise SecretsError(f"{source}: the secrets section's {key} is not a list")
    return section


def read_dump_file(path: str) -> dict[str, Any]:
    """A saved config dump (``-`` is stdin), read by the config-dump views' reader."""
    from istio_agent.ctl.configdump.source import ConfigDumpError, read_file

    try:
        text = read_file(path, MAX_DUMP)
    except ConfigDumpError as err:
        raise SecretsError(str(err)) from None
    return parse_dump(text, path)


async def _get(address: str, target: str, what: str, timeout: float) -> tuple[int, bytes]:
    from istio_agent.ctl.configdump.source import ConfigDumpError, get

    try:
        return await get(address, target, timeout, what)
    except ConfigDumpError as err:
        raise SecretsError(str(err)) from None


async def fetch_dump(address: str, timeout: float) -> dict[str, Any]:
    """Envoy's secrets config dump from its admin address."""
    status, body = await _get(address, CONFIG_DUMP_TARGET, "Envoy's admin", timeout)
    if status != 200:
        raise SecretsError(
            f"Envoy's admin at {address} answered {status}: {body[:200].decode(errors='replace').strip()}"
        )
    return parse_dump(body, f"the answer of {address}")


async def fetch_agent_view(address: str, timeout: float) -> dict[str, Any]:
    """The agent's ``/debug/secrets`` document."""
    status, body = await _get(address, AGENT_SECRETS_TARGET, "the agent", timeout)
    if status == 403:
        raise SecretsError(
            f"the agent at {address} refused: {AGENT_SECRETS_TARGET} answers loopback callers only"
        )
    if status == 404:
        raise SecretsError(
            f"the agent at {address} has no {AGENT_SECRETS_TARGET} (not istio-agent, or no secrets yet)"
        )
    if status != 200:
        raise SecretsError(f"the agent at {address} answered {status}")
    return _json_with_list(body, "secrets", f"the agent at {address} answered no secrets view")


def has_active_or_warming(section: dict[str, Any]) -> bool:
    return bool(section.get("dynamic_active_secrets") or section.get("dynamic_warming_secrets"))


# -- items from Envoy ----------------------------------------------------------------------------------
def _inline(source: Any) -> tuple[str, str | None]:
    """A DataSource's inline bytes as text, and a problem when they are not base64."""
    if not isinstance(source, dict):
        return "", None
    if "inline_bytes" in source:
        try:
            return base64.b64decode(source["inline_bytes"], validate=True).decode("utf-8", "replace"), None
        except (binascii.Error, TypeError, ValueError):
            return "", "inline_bytes is not base64"
    if isinstance(source.get("inline_string"), str):
        return source["inline_string"], None
    return "", None


def _entries(secret: dict[str, Any]) -> list[tuple[str, str, bool, list[str]]]:
    """(data, trust domain, is a bundle, problems) for each item one Envoy secret becomes."""
    tls = secret.get("tls_certificate")
    validation = secret.get("validation_context")
    chain, problem = _inline(tls.get("certificate_chain") if isinstance(tls, dict) else None)
    if chain or problem:
        return [(chain, "", False, [problem] if problem else [])]
    if isinstance(validation, dict):
        bundle, problem = _inline(validation.get("trusted_ca"))
        if bundle or problem:
            return [(bundle, "", True, [problem] if problem else [])]
        custom = validation.get("custom_validator_config")
        typed = custom.get("typed_config") if isinstance(custom, dict) else None
        if isinstance(typed, dict) and typed.get("@type") == SPIFFE_VALIDATOR_TYPE:
            entries = []
            for domain in typed.get("trust_domains") or []:
                if isinstance(domain, dict):
                    data, problem = _inline(domain.get("trust_bundle"))
                    entries.append((data, str(domain.get("name", "")), True, [problem] if problem else []))
            if entries:
                return entries
    return [("", "", isinstance(validation, dict), [])]


def _fill_meta(item: SecretItem, certs: list[CertificateSummary], now: datetime) -> None:
    """SecretMeta from the first certificate, as istioctl: type, serial, dates, validity, trust domain."""
    if not certs:
        return
    first = certs[0]
    item.certificates = tuple(certs)
    item.type = "CA" if first.is_ca else "Cert Chain"
    item.serial_number = first.serial_number
    item.not_after, item.not_before = rfc3339(first.not_after), rfc3339(first.not_before)
    item.valid = first.not_before < now < first.not_after
    item.seconds_to_expiry = int((first.not_after - now).total_seconds())
    if not item.trust_domain:
        spiffe = next((uri for uri in first.uris if uri.startswith("spiffe://")), "")
        item.trust_domain = spiffe.removeprefix("spiffe://").split("/", 1)[0]
    if now >= first.not_after:
        item.problems.append(f"certificate {first.serial_number} expired {relative(first.not_after, now)}")
    elif now <= first.not_before:
        item.problems.append(f"certificate {first.serial_number} is not valid before {item.not_before}")


def envoy_items(section: dict[str, Any], now: datetime | None = None) -> list[SecretItem]:
    """Envoy's secrets as items (warming, then active, then static), each chain checked against the bundles."""
    now = now or datetime.now(UTC)
    items: list[SecretItem] = []
    parsed: dict[int, list[Any]] = {}
    for key, state in (
        ("dynamic_warming_secrets", "WARMING"),
        ("dynamic_active_secrets", "ACTIVE"),
        ("static_secrets", "STATIC"),
    ):
        for entry in section.get(key) or []:
            if not isinstance(entry, dict):
                continue
            name = str(entry.get("name", ""))
            secret = entry.get("secret")
            if not isinstance(secret, dict):
                secret = {}
            for data, trust_domain, is_bundle, problems in _entries(secret):
                item = SecretItem(
                    name, data=data, state=state, trust_domain=trust_domain, is_bundle=is_bundle
                )
                item.problems.extend(problems)
                certs = []
                if data:
                    try:
                        certs = parse_certificates(data)
                    except PemError as err:
                        item.problems.append(f"cannot parse its certificates: {err}")
                _fill_meta(item, [CertificateSummary.of(c) for c in certs], now)
                parsed[id(item)] = certs
                items.append(item)
    bundles: dict[str, list[Any]] = {}
    for item in items:
        if item.is_bundle and item.state != "WARMING":
            bundles.setdefault(item.name, []).extend(parsed[id(item)])
    for item in items:
        chain = parsed[id(item)]
        if item.is_bundle or not chain:
            continue
        names = trust_bundle_names(item.name, bundles)
        anchors = [c for name in names for c in bundles[name]]
        if not anchors:
            continue  # e.g. a gateway certificate from a public CA: nothing here to check it against
        problem = chain_problem(chain, anchors, now)
        item.chain_verified = problem is None
        if problem is not None:
            item.problems.append(f"chain does not verify against {' or '.join(names)}: {problem}")
    return items


def trust_bundle_names(name: str, bundles: Mapping[str, object]) -> list[str]:
    """The trust bundles among ``bundles`` that a certificate chain named ``name`` must lead to.

    Istio's SDS names pair them so: the workload certificate ``default`` with the mesh's ``ROOTCA``;
    a gateway's ``credentialName`` secret ``X`` with ``X-cacert`` (Istio's ``SdsCaSuffix``, present
    only when the secret carries a CA for mutual TLS); a mounted ``file-cert:...`` with the mounted
    ``file-root:...`` bundles. Any other chain has none: it may come from any CA (a public one for a
    gateway) and is not checked."""
    if name == WORKLOAD_SECRET:
        wanted = [ROOT_SECRET]
    elif name.startswith(FILE_CERT_PREFIX):
        wanted = sorted(n for n in bundles if n.startswith(FILE_ROOT_PREFIX))
    else:
        wanted = [name + CA_SECRET_SUFFIX]
    return [n for n in wanted if n in bundles]


# -- the agent's side and the comparison ---------------------------------------------------------------
def _summaries(entry: dict[str, Any]) -> list[CertificateSummary]:
    return [CertificateSummary.from_json(c) for c in entry.get("certificates") or [] if isinstance(c, dict)]


def agent_items(view: dict[str, Any], source: str, now: datetime | None = None) -> list[SecretItem]:
    """The agent's secrets (from ``/debug/secrets``) as items whose Source is the agent."""
    now = now or datetime.now(UTC)
    items = []
    for entry in view.get("secrets") or []:
        if not isinstance(entry, dict):
            continue
        item = SecretItem(
            str(entry.get("resource_name", "")), source=source, is_bundle=entry.get("kind") == "root"
        )
        if entry.get("error"):
            item.problems.append(f"the agent cannot parse it: {entry['error']}")
        _fill_meta(item, _summaries(entry), now)
        items.append(item)
    return items


def diff(proxy: list[SecretItem], agent: list[SecretItem]) -> list[SecretItemDiff]:
    """istioctl's historic comparison: Envoy's items by content, the agent's matched to them or added.

    Content is the resource name and the certificates' fingerprints (istioctl compared the exact
    PEM text, which the agent's view does not carry). Sorted by Envoy's state, stable.
    """
    rows = [SecretItemDiff(agent="", proxy=item.state, item=item) for item in proxy]
    by_content = {(row.item.name, row.item.fingerprints): row for row in rows}
    for item in agent:
        row = by_content.get((item.name, item.fingerprints))
        if row is not None:
            row.agent = PRESENT
            row.item.source = item.source
        else:
            rows.append(SecretItemDiff(agent=PRESENT, proxy="", item=item))
    return sorted(rows, key=lambda row: row.item.state)


def mismatches(rows: list[SecretItemDiff]) -> list[str]:
    """One line for each secret the agent holds that Envoy does not hold the same."""
    lines = []
    for row in rows:
        if row.agent != PRESENT or row.proxy:
            continue
        name = row.item.name
        envoy = [r.item for r in rows if r.item.name == name and r.proxy == "ACTIVE"]
        if envoy:
            held = ", ".join(i.serial_number or "no certificate" for i in envoy)
            lines.append(
                f"{name}: Envoy holds serial {held}, the agent holds serial "
                f"{row.item.serial_number or '(none)'}: Envoy has not received the agent's current secret"
            )
        else:
            lines.append(
                f"{name}: the agent holds serial {row.item.serial_number or '(none)'}, Envoy has no such secret"
            )
    return lines


def check_files(view: dict[str, Any], proxy: list[SecretItem]) -> list[FileCheck]:
    """The agent's certificate files against what Envoy loaded for the same resource name."""
    checks = []
    for entry in view.get("files") or []:
        if not isinstance(entry, dict):
            continue
        path, name = str(entry.get("path", "")), str(entry.get("resource_name", ""))
        facts = {"md5": str(entry.get("md5", "")), "sha256": str(entry.get("sha256", ""))}
        if entry.get("error"):
            checks.append(FileCheck(path, name, "ERROR", error=str(entry["error"]), **facts))
            continue
        certs = _summaries(entry)
        serial = certs[0].serial_number if certs else ""
        loaded = [i for i in proxy if i.name == name and i.state in ("ACTIVE", "STATIC")]
        if not loaded:
            checks.append(FileCheck(path, name, "NOT IN ENVOY", serial_number=serial, **facts))
            continue
        mine = tuple(c.sha256 for c in certs)
        same = any(
            (set(mine) <= set(i.fingerprints) if i.is_bundle else mine == i.fingerprints) and mine
            for i in loaded
        )
        checks.append(FileCheck(path, name, "SAME" if same else "DIFFERENT", serial_number=serial, **facts))
    return checks


def relative(moment: datetime, now: datetime) -> str:
    """``in 23h4m`` or ``3m12s ago``: the two largest units, to the second."""
    seconds = int((moment - now).total_seconds())
    left = abs(seconds)
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size or (unit == "s" and not parts):
            count, left = divmod(left, size)
            parts.append(f"{count}{unit}")
        if len(parts) == 2:
            break
    text = "".join(parts)
    return f"in {text}" if seconds > 0 else f"{text} ago"


def expiry_text(item: SecretItem, now: datetime) -> str:
    """The EXPIRES column: ``in 23h4m``, ``expired 3m12s ago``, ``valid in 5m`` (not yet), or empty."""
    if not item.certificates:
        return ""
    first = item.certificates[0]
    if now <= first.not_before:
        return f"valid {relative(first.not_before, now)}"
    if now >= first.not_after:
        return f"expired {relative(first.not_after, now)}"
    return relative(first.not_after, now)
