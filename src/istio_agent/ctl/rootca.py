"""``agentctl proxy-config rootca-compare``: do two Envoys trust a common root?

As istioctl 1.28 (``istioctl/pkg/proxyconfig/proxyconfig.go``, ``rootCACompareConfigCmd``): each
Envoy's ROOTCA is the trusted CA of the *active dynamic* secret named ``ROOTCA`` (static and
warming secrets do not count); the two match when one certificate of the first bundle is byte for
byte one of the second's (so a bundle mid root rotation still matches either root). A match is a
report; a mismatch is an error (exit status 1). The messages are istioctl's.

One difference: istioctl 1.28 base64-decodes the trusted CA's bytes a second time after its JSON
decoding (``GetRootCAFromSecretConfigDump``), which fails on the PEM Envoy holds; we decode once.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from istio_agent.ctl.secrets import SecretsError, fetch_dump, secrets_dump
from istio_agent.pem import PemError, parse_certificates

ROOTCA = "ROOTCA"
_NO_CERTIFICATE = "no PEM encoded certificate found"


class RootCAError(Exception):
    """The comparison could not be made, or found no common root; the message is istioctl's."""


def match_message(first: str, second: str) -> str:
    return (
        f"Both [{first}] and [{second}] have the identical ROOTCA, "
        "theoretically the connectivity between them is available"
    )


def mismatch_message(first: str, second: str) -> str:
    return (
        f"Both [{first}] and [{second}] have the non identical ROOTCA, "
        "theoretically the connectivity between them is unavailable"
    )


def _trusted_ca(secret: Any) -> bytes:
    """The PEM of a ROOTCA secret's trusted CA (istioctl's errors, without its prefix)."""
    validation = secret.get("validation_context") if isinstance(secret, dict) else None
    if not isinstance(validation, dict):
        raise RootCAError("cannot find ROOTCA from secret config dump")
    trusted = validation.get("trusted_ca")
    if not isinstance(trusted, dict):
        raise RootCAError("cannot retrieve trustedCa from secret ROOTCA")
    inline = trusted.get("inline_bytes")
    if not isinstance(inline, str):
        raise RootCAError("cannot retrieve inlineBytes from trustCA section")
    try:
        return base64.b64decode(inline, validate=True)
    except (binascii.Error, ValueError) as err:
        raise RootCAError(f"failed to decode inlinebytes: {err}") from None


def root_ca(dump: dict[str, Any]) -> bytes:
    """The ROOTCA bundle (PEM) of an Envoy config dump, as istioctl finds it."""
    try:
        section = secrets_dump(dump, "sidecar doesn't support secrets")
    except SecretsError as err:
        raise RootCAError(str(err)) from None
    for entry in section.get("dynamic_active_secrets") or []:
        if isinstance(entry, dict) and entry.get("name") == ROOTCA:
            try:
                return _trusted_ca(entry.get("secret"))
            except RootCAError as err:
                raise RootCAError(f"can not dump ROOTCA from secret: {err}") from None
    raise RootCAError("cannot find ROOTCA from secret")


def parse_pem_certs(data: bytes) -> list[bytes]:
    """The DER of every certificate in a PEM bundle; istioctl's errors when there is none or one is bad."""
    try:
        return [c.der for c in parse_certificates(data)]
    except PemError as err:
        if str(err) == _NO_CERTIFICATE:
            raise RootCAError(f"failed to parse certificates: {data.decode(errors='replace')}") from None
        raise RootCAError(f"failed to parse certificate: {err}") from None


def share_a_certificate(first: bytes, second: bytes) -> bool:
    """Whether the two bundles hold one identical certificate (istioctl's checkRootCACertMatchExist)."""
    return not set(parse_pem_certs(first)).isdisjoint(parse_pem_certs(second))


async def compare(first: str, second: str, timeout: float) -> str:
    """The match report for two Envoy admin addresses; RootCAError with the mismatch report otherwise."""
    bundles = []
    for address in (first, second):
        try:
            dump = await fetch_dump(address, timeout)
        except SecretsError as err:
            raise RootCAError(str(err)) from None
        bundles.append(root_ca(dump))
    if share_a_certificate(*bundles):
        return match_message(first, second)
    raise RootCAError(mismatch_message(first, second))
