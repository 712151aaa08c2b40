"""Tokens: ES256 JWTs minted from the state directory's key, and every way verification refuses one."""

from __future__ import annotations

import base64
import json
import stat
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from istio_agent.controlplane.tokens import Identity, TokenError, TokenVerifier, mint_token


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def sign(state: Path, header: dict[str, Any], claims: dict[str, Any]) -> str:
    """An independent ES256 signer over the state directory's key, for hand-made claims."""
    key = serialization.load_pem_private_key((state / "token-signing-key.pem").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
    r, s = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
    return f"{signing_input}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def claims_of(token: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(unb64(token.split(".")[1]))
    return result


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def verifier(state: Path) -> TokenVerifier:
    return TokenVerifier(state)


def test_round_trip(state: Path) -> None:
    token = mint_token(state, "default", "sleep")
    assert stat.S_IMODE((state / "token-signing-key.pem").stat().st_mode) == 0o600
    # A verifier built later from the same directory uses the same key.
    identity = TokenVerifier(state).verify(token)
    assert identity == Identity("default", "sleep")
    assert identity.spiffe_id("example.org") == "spiffe://example.org/ns/default/sa/sleep"


def test_claims_look_like_a_kubernetes_projected_token(state: Path) -> None:
    token = mint_token(state, "prod", "api", ttl=timedelta(hours=2))
    header = json.loads(unb64(token.split(".")[0]))
    assert header["alg"] == "ES256" and header["typ"] == "JWT"
    claims = claims_of(token)
    assert claims["iss"] == "agentctl-controlplane"
    assert claims["sub"] == "system:serviceaccount:prod:api"
    assert claims["aud"] == ["istio-ca"]
    assert claims["exp"] - claims["iat"] == 7200 and claims["nbf"] == claims["iat"]
    assert abs(claims["iat"] - time.time()) < 5
    assert claims["kubernetes.io"] == {"namespace": "prod", "serviceaccount": {"name": "api"}}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"namespace": "Bad_NS"}, "invalid namespace"),
        ({"service_account": "a/b"}, "invalid service account"),
        ({"ttl": timedelta(0)}, "must be positive"),
        ({"audience": ""}, "audience"),
    ],
)
def test_mint_rejects_bad_arguments(state: Path, kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"namespace": "default", "service_account": "sleep", **kwargs}
    with pytest.raises(ValueError, match=message):
        mint_token(state, **args)


def test_token_from_another_state_dir_is_refused(tmp_path: Path, verifier: TokenVerifier) -> None:
    foreign = mint_token(tmp_path / "other", "default", "sleep")
    with pytest.raises(TokenError, match="signature is invalid"):
        verifier.verify(foreign)


def test_tampered_payload_is_refused(state: Path, verifier: TokenVerifier) -> None:
    header, _, signature = mint_token(state, "default", "sleep").split(".")
    claims = claims_of(mint_token(state, "kube-system", "admin"))
    forged = f"{header}.{b64(json.dumps(claims).encode())}.{signature}"
    with pytest.raises(TokenError, match="signature is invalid"):
        verifier.verify(forged)


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("", "malformed token"),
        ("abc", "malformed token"),
        ("a.b", "malformed token"),
        ("a..c", "malformed token"),
        ("a.b.c.d", "malformed token"),
        ("!!!.e30.AAAA", "header is not valid base64url"),
        (f"{b64(b'not json')}.e30.AAAA", "header is not valid JSON"),
        (f"{b64(b'[1]')}.e30.AAAA", "header is not a JSON object"),
        ("x" * 20000, "larger than"),
    ],
)
def test_malformed_tokens_are_refused(verifier: TokenVerifier, token: str, message: str) -> None:
    with pytest.raises(TokenError, match=message):
        verifier.verify(token)


@pytest.mark.parametrize("alg", ["none", "HS256", "RS256", None])
def test_wrong_alg_is_refused(state: Path, verifier: TokenVerifier, alg: str | None) -> None:
    _, payload, signature = mint_token(state, "default", "sleep").split(".")
    header = b64(json.dumps({"alg": alg, "typ": "JWT"}).encode())
    with pytest.raises(TokenError, match="unsupported token alg"):
        verifier.verify(f"{header}.{payload}.{signature}")


def test_bad_signature_encoding_is_refused(state: Path, verifier: TokenVerifier) -> None:
    header, payload, signature = mint_token(state, "default", "sleep").split(".")
    with pytest.raises(TokenError, match="signature is not valid base64url"):
        verifier.verify(f"{header}.{payload}.{signature[:-2]}*+")
    with pytest.raises(TokenError, match="wrong length"):
        verifier.verify(f"{header}.{payload}.{signature[:40]}")


def test_payload_that_is_not_json_is_refused(state: Path, verifier: TokenVerifier) -> None:
    TokenVerifier(state)  # make sure the key exists
    key = serialization.load_pem_private_key((state / "token-signing-key.pem").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    signing_input = f"{b64(json.dumps({'alg': 'ES256'}).encode())}.{b64(b'{oops')}"
    r, s = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
    token = f"{signing_input}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"
    with pytest.raises(TokenError, match="payload is not valid JSON"):
        verifier.verify(token)


def test_expiry_with_leeway(state: Path, verifier: TokenVerifier) -> None:
    now = datetime.now(UTC)
    expired = mint_token(state, "default", "sleep", ttl=timedelta(hours=1), now=now - timedelta(hours=2))
    with pytest.raises(TokenError, match="expired"):
        verifier.verify(expired)
    # Ten seconds past expiry is within the leeway.
    just_expired = mint_token(
        state, "default", "sleep", ttl=timedelta(minutes=1), now=now - timedelta(seconds=70)
    )
    assert verifier.verify(just_expired).service_account == "sleep"


def test_not_yet_valid(state: Path, verifier: TokenVerifier) -> None:
    future = mint_token(state, "default", "sleep", now=datetime.now(UTC) + timedelta(hours=1))
    with pytest.raises(TokenError, match="not valid yet"):
        verifier.verify(future)
    assert verifier.verify(future, now=time.time() + 3600).namespace == "default"


def test_wrong_audience(state: Path, verifier: TokenVerifier) -> None:
    token = mint_token(state, "default", "sleep", audience="kubernetes.default.svc")
    with pytest.raises(TokenError, match="audience does not include istio-ca"):
        verifier.verify(token)
    assert TokenVerifier(state, audience="kubernetes.default.svc").verify(token).namespace == "default"


def _good_claims() -> dict[str, Any]:
    now = int(time.time())
    return {
        "iss": "agentctl-controlplane",
        "sub": "system:serviceaccount:default:sleep",
        "aud": "istio-ca",
        "iat": now,
        "exp": now + 600,
        "kubernetes.io": {"namespace": "default", "serviceaccount": {"name": "sleep"}},
    }


def test_hand_signed_good_claims_pass(state: Path, verifier: TokenVerifier) -> None:
    # Also proves the format: an independent ES256 signer with a plain-string aud is accepted.
    assert verifier.verify(sign(state, {"alg": "ES256"}, _good_claims())) == Identity("default", "sleep")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"exp": None}, "exp claim is missing"),
        ({"exp": "tomorrow"}, "exp claim is missing or not a number"),
        ({"exp": True}, "exp claim is missing or not a number"),
        ({"aud": None}, "no aud claim"),
        ({"aud": []}, "no aud claim"),
        ({"iss": None}, "issuer"),
        ({"iss": "https://kubernetes.default.svc"}, "issuer"),
        ({"kubernetes.io": None}, "lacks the kubernetes.io"),
        ({"kubernetes.io": {"namespace": "default"}}, "lacks the kubernetes.io"),
        ({"kubernetes.io": {"namespace": "a/b", "serviceaccount": {"name": "x"}}}, "invalid namespace"),
        ({"sub": None}, "sub claim does not match"),
        ({"sub": "system:serviceaccount:kube-system:admin"}, "sub claim does not match"),
        ({"nbf": "soon"}, "nbf claim"),
    ],
)
def test_missing_or_bad_claims(
    state: Path, verifier: TokenVerifier, change: dict[str, Any], message: str
) -> None:
    claims = _good_claims()
    for name, value in change.items():
        if value is None:
            del claims[name]
        else:
            claims[name] = value
    with pytest.raises(TokenError, match=message):
        verifier.verify(sign(state, {"alg": "ES256"}, claims))


def test_errors_never_contain_the_token(state: Path, verifier: TokenVerifier) -> None:
    token = mint_token(state, "default", "sleep", audience="elsewhere")
    with pytest.raises(TokenError) as err:
        verifier.verify(token)
    for part in token.split("."):
        assert part not in str(err.value)
