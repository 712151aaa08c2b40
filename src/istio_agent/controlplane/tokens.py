"""Service-account tokens for the local control plane: a minimal ES256 JWT, minted and verified here.

The claims mirror a Kubernetes projected token (audience ``istio-ca``), so the agent reads and sends
it exactly as it would in a cluster. Only what the CA needs is implemented: one algorithm, one key
kept in the state directory, no key rotation.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature

from istio_agent.controlplane.ca import (
    load_ec_key,
    locked_state_dir,
    new_ec_key,
    private_key_pem,
    write_state_file,
)

SIGNING_KEY_FILE = "token-signing-key.pem"
ISSUER = "agentctl-controlplane"
DEFAULT_AUDIENCE = "istio-ca"
DEFAULT_TTL = timedelta(hours=24)
LEEWAY_SECONDS = 30
MAX_TOKEN_BYTES = 16 * 1024
_ALG = "ES256"
_COORD_BYTES = 32  # P-256 coordinates; JWS carries r || s, not DER
_K8S = "kubernetes.io"
# Kubernetes namespace / service account names: RFC 1123 labels and subdomains.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_B64URL = re.compile(r"^[A-Za-z0-9_-]*$")


class TokenError(Exception):
    """A token was refused; ``reason`` says why and never contains the token."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Identity:
    """The Kubernetes service account a token speaks for."""

    namespace: str
    service_account: str

    def spiffe_id(self, trust_domain: str) -> str:
        return f"spiffe://{trust_domain}/ns/{self.namespace}/sa/{self.service_account}"


def _signing_key(state_dir: Path) -> ec.EllipticCurvePrivateKey:
    """The token signing key of ``state_dir``, made (mode 0600) the first time it is needed."""
    path = state_dir / SIGNING_KEY_FILE
    with locked_state_dir(state_dir):
        if path.exists():
            return load_ec_key(path)
        key = new_ec_key()
        write_state_file(path, private_key_pem(key), 0o600)
        return key


def _key_id(public_key: ec.EllipticCurvePublicKey) -> str:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return _b64encode(hashlib.sha256(der).digest()[:16])


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(part: str, what: str) -> bytes:
    if not _B64URL.match(part) or len(part) % 4 == 1:
        raise TokenError(f"token {what} is not valid base64url")
    try:
        return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
    except (binascii.Error, ValueError) as err:
        raise TokenError(f"token {what} is not valid base64url") from err


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenError(f"token {what} is not valid JSON") from err
    if not isinstance(value, dict):
        raise TokenError(f"token {what} is not a JSON object")
    return value


def _check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:80] + "..."
        raise ValueError(f"invalid {what} {shown}: use lower-case letters, digits, '-' and '.'")
    return value


def mint_token(
    state_dir: Path,
    namespace: str,
    service_account: str,
    ttl: timedelta = DEFAULT_TTL,
    audience: str = DEFAULT_AUDIENCE,
    *,
    now: datetime | None = None,
) -> str:
    """A token the local control plane accepts for ``namespace``/``service_account``.

    ValueError when a name, the lifetime or the audience is invalid.
    """
    _check_name(namespace, "namespace")
    _check_name(service_account, "service account")
    if ttl <= timedelta(0):
        raise ValueError(f"token lifetime must be positive, got {ttl}")
    if not audience:
        raise ValueError("token audience must not be empty")
    key = _signing_key(state_dir)
    issued = int((now or datetime.now(UTC)).timestamp())
    header = {"alg": _ALG, "typ": "JWT", "kid": _key_id(key.public_key())}
    claims = {
        "iss": ISSUER,
        "sub": f"system:serviceaccount:{namespace}:{service_account}",
        "aud": [audience],
        "iat": issued,
        "nbf": issued,
        "exp": issued + int(ttl.total_seconds()),
        _K8S: {"namespace": namespace, "serviceaccount": {"name": service_account}},
    }
    signing_input = ".".join(
        _b64encode(json.dumps(part, separators=(",", ":")).encode()) for part in (header, claims)
    )
    r, s = decode_dss_signature(key.sign(signing_input.encode("ascii"), ec.ECDSA(hashes.SHA256())))
    signature = r.to_bytes(_COORD_BYTES, "big") + s.to_bytes(_COORD_BYTES, "big")
    return f"{signing_input}.{_b64encode(signature)}"


class TokenVerifier:
    """Verifies tokens minted with the state directory's signing key (made there if missing)."""

    def __init__(self, state_dir: Path, audience: str = DEFAULT_AUDIENCE) -> None:
        self._public_key = _signing_key(state_dir).public_key()
        self._audience = audience

    def verify(self, token: str, *, now: float | None = None) -> Identity:
        """The identity a valid token speaks for; TokenError otherwise."""
        if len(token) > MAX_TOKEN_BYTES:
            raise TokenError(f"token is larger than {MAX_TOKEN_BYTES} bytes")
        parts = token.strip().split(".")
        if len(parts) != 3 or not all(parts):
            raise TokenError("malformed token: expected three non-empty dot-separated parts")
        header = _json_object(_b64decode(parts[0], "header"), "header")
        if header.get("alg") != _ALG:
            raise TokenError(f"unsupported token alg {str(header.get('alg'))[:20]!r}, expected {_ALG}")
        self._check_signature(parts)
        claims = _json_object(_b64decode(parts[1], "payload"), "payload")
        return self._check_claims(claims, time.time() if now is None else now)

    def _check_signature(self, parts: list[str]) -> None:
        raw = _b64decode(parts[2], "signature")
        if len(raw) != 2 * _COORD_BYTES:
            raise TokenError("token signature has the wrong length for ES256")
        r = int.from_bytes(raw[:_COORD_BYTES], "big")
        s = int.from_bytes(raw[_COORD_BYTES:], "big")
        signing_input = f"{parts[0]}.{parts[1]}".encode("ascii")
        try:
            self._public_key.verify(encode_dss_signature(r, s), signing_input, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            raise TokenError("token signature is invalid") from None

    def _check_claims(self, claims: dict[str, Any], now: float) -> Identity:
        if claims.get("iss") != ISSUER:
            raise TokenError(f"token issuer is not {ISSUER}")
        exp = _time_claim(claims, "exp", required=True)
        if now > exp + LEEWAY_SECONDS:
            raise TokenError("token has expired")
        for claim in ("nbf", "iat"):
            if now + LEEWAY_SECONDS < _time_claim(claims, claim, required=False):
                raise TokenError("token is not valid yet")
        audiences = claims.get("aud")
        if isinstance(audiences, str):
            audiences = [audiences]
        if not isinstance(audiences, list) or not audiences:
            raise TokenError("token has no aud claim")
        if self._audience not in audiences:
            raise TokenError(f"token audience does not include {self._audience}")
        k8s = claims.get(_K8S)
        namespace = k8s.get("namespace") if isinstance(k8s, dict) else None
        account = k8s.get("serviceaccount") if isinstance(k8s, dict) else None
        name = account.get("name") if isinstance(account, dict) else None
        if not isinstance(namespace, str) or not isinstance(name, str):
            raise TokenError(f"token lacks the {_K8S} namespace and serviceaccount.name claims")
        try:
            identity = Identity(_check_name(namespace, "namespace"), _check_name(name, "service account"))
        except ValueError as err:
            raise TokenError(f"token {err}") from None
        if claims.get("sub") != f"system:serviceaccount:{namespace}:{name}":
            raise TokenError(f"token sub claim does not match its {_K8S} claims")
        return identity


def _time_claim(claims: dict[str, Any], name: str, *, required: bool) -> float:
    value = claims.get(name)
    if value is None and not required:
        return float("-inf")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TokenError(f"token {name} claim is missing or not a number")
    return float(value)
