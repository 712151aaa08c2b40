"""The OCI image fetcher against a real registry (Debian's docker-registry), and its pull-secret reading.

Cases after Istio's ``pkg/wasm/imagefetcher_test.go`` (1.28.10 and HEAD): the three image formats,
tag and digest references, pull secrets, the bearer realm guard, an image of no Wasm format.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from istio_agent.wasm.dockerconfig import ANONYMOUS, Credentials, credentials_for, default_credentials
from istio_agent.wasm.errors import FetchError


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# --- pull secrets (docker config JSON) ---


def test_pull_secret_auth_for_the_registry() -> None:
    config = json.dumps({"auths": {"test.io": {"auth": b64("foo:bar")}}}).encode()
    assert credentials_for(config, "test.io") == Credentials("foo", "bar")


def test_pull_secret_username_and_password_fields() -> None:
    config = json.dumps({"auths": {"reg:5000": {"username": "u", "password": "p"}}}).encode()
    assert credentials_for(config, "reg:5000") == Credentials("u", "p")


def test_pull_secret_auth_wins_over_username_and_password() -> None:
    entry = {"auth": b64("a:b:c"), "username": "u", "password": "p"}
    config = json.dumps({"auths": {"reg": entry}}).encode()
    assert credentials_for(config, "reg") == Credentials("a", "b:c")


@pytest.mark.parametrize(
    "key", ["https://reg.example:5000", "http://reg.example:5000/v1/", "reg.example:5000/v2"]
)
def test_pull_secret_key_with_scheme_or_path_matches_the_host(key: str) -> None:
    config = json.dumps({"auths": {key: {"auth": b64("u:p")}}}).encode()
    assert credentials_for(config, "reg.example:5000") == Credentials("u", "p")


def test_pull_secret_exact_key_wins_over_a_legacy_one() -> None:
    auths = {"https://reg.example": {"auth": b64("old:x")}, "reg.example": {"auth": b64("new:y")}}
    assert credentials_for(json.dumps({"auths": auths}).encode(), "reg.example") == Credentials("new", "y")


def test_pull_secret_docker_hub_key() -> None:
    config = json.dumps({"auths": {"https://index.docker.io/v1/": {"auth": b64("u:p")}}}).encode()
    assert credentials_for(config, "index.docker.io") == Credentials("u", "p")


def test_pull_secret_without_the_registry_is_anonymous() -> None:
    config = json.dumps({"auths": {"other.io": {"auth": b64("u:p")}}}).encode()
    assert credentials_for(config, "test.io") is ANONYMOUS
    assert credentials_for(b"{}", "test.io") is ANONYMOUS


def test_pull_secret_credential_helpers_are_not_run() -> None:
    config = json.dumps({"credsStore": "evil", "credHelpers": {"test.io": "evil"}}).encode()
    assert credentials_for(config, "test.io") is ANONYMOUS


@pytest.mark.parametrize(
    "config",
    [b"null", b"not json", b"[]", b'{"auths": []}', b'{"auths": {"test.io": "x"}}'],
)
def test_pull_secret_that_is_no_docker_config_is_an_error(config: bytes) -> None:
    with pytest.raises(FetchError):
        credentials_for(config, "test.io")


def test_pull_secret_bad_auth_is_an_error_without_the_secret() -> None:
    config = json.dumps({"auths": {"test.io": {"auth": b64("no-colon-secret")}}}).encode()
    with pytest.raises(FetchError) as caught:
        credentials_for(config, "test.io")
    assert "no-colon-secret" not in str(caught.value)
    assert "not base64 of user:password" in str(caught.value)


def test_credentials_repr_hides_the_password() -> None:
    assert "hunter2" not in repr(Credentials("u", "hunter2"))


def test_default_credentials_from_docker_config_dir(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"auths": {"reg": {"auth": b64("u:p")}}}))
    assert default_credentials("reg", {"DOCKER_CONFIG": str(tmp_path)}) == Credentials("u", "p")
    assert default_credentials("reg", {"HOME": str(tmp_path / "nobody")}) is ANONYMOUS
