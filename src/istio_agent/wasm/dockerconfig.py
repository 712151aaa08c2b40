"""Registry credentials from a docker config JSON: a WasmPlugin's image pull secret, or the agent's own.

Istio hands the pull secret's ``.dockerconfigjson`` to docker/cli's config loader and looks the
registry up as docker does (``pkg/wasm/imagefetcher.go``, ``wasmKeyChain``): the entry under the
registry's name exactly, else the first whose key names that host once a scheme and path are
stripped (``https://host:5000/v1/``). ``auth`` (base64 ``user:password``) wins over ``username`` /
``password``. Credential helpers (``credsStore``, ``credHelpers``) are never run: a secret from
mesh config must not make the agent execute programs.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from istio_agent.wasm.errors import FetchError

DOCKER_HUB = "index.docker.io"
DOCKER_HUB_KEY = "https://index.docker.io/v1/"
"""The key docker (and go-containerregistry) file Docker Hub's credentials under."""


@dataclass(frozen=True)
class Credentials:
    """What a registry may be shown: a user and password (Basic, or for a token), or a token."""

    username: str = ""
    password: str = ""
    registry_token: str = ""
    """Sent as the registry's bearer token as is, with no token exchange."""
    identity_token: str = ""
    """An OAuth2 refresh token, exchanged at the registry's token realm for a bearer token."""

    def __repr__(self) -> str:  # never print a secret
        return f"Credentials(username={self.username!r}, password=<redacted>)"

    @property
    def anonymous(self) -> bool:
        return not (self.username or self.password or self.registry_token or self.identity_token)


ANONYMOUS = Credentials()


def credentials_for(config: bytes, registry: str) -> Credentials:
    """The credentials ``config`` (docker config JSON) holds for ``registry`` (``host[:port]``), or
    ``ANONYMOUS``; ``FetchError`` when it is not a docker config (its content is never quoted)."""
    try:
        document = json.loads(config)
    except (ValueError, UnicodeDecodeError):
        raise FetchError("the image pull secret is not JSON (expected a docker config)") from None
    if not isinstance(document, dict):
        raise FetchError("the image pull secret is not a docker config JSON object")
    auths = document.get("auths", {})
    if auths is None:
        auths = {}
    if not isinstance(auths, dict):
        raise FetchError('the image pull secret\'s "auths" is not an object')
    key = DOCKER_HUB_KEY if registry == DOCKER_HUB else registry
    entry = auths.get(key)
    if entry is None:
        entry = next((value for name, value in auths.items() if _hostname(name) == key), None)
    if entry is None:
        return ANONYMOUS
    return _decode(entry, key)


def default_credentials(registry: str, environ: dict[str, str] | None = None) -> Credentials:
    """What the agent's own docker config holds for ``registry``: ``$DOCKER_CONFIG/config.json``, else
    ``~/.docker/config.json`` (go-containerregistry's default keychain without helpers); an agent
    pod has neither, so this is anonymous in practice. An unreadable or invalid file is anonymous."""
    env = os.environ if environ is None else environ
    directory = env.get("DOCKER_CONFIG") or str(Path(env.get("HOME", "~")).expanduser() / ".docker")
    try:
        config = (Path(directory) / "config.json").read_bytes()
        return credentials_for(config, registry)
    except (OSError, FetchError):
        return ANONYMOUS


def _hostname(key: str) -> str:
    """docker's ConvertToHostname: a key with a scheme is its URL's host[:port], else up to a slash."""
    if "://" in key:
        try:
            parts = urlsplit(key)
            if parts.hostname:
                host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
                return f"{host}:{parts.port}" if parts.port is not None else host
        except ValueError:
            pass
    return key.split("/", 1)[0]


def _decode(entry: object, key: str) -> Credentials:
    if not isinstance(entry, dict):
        raise FetchError(f"the image pull secret's entry for {key} is not an object")
    names = ("auth", "username", "password", "registrytoken", "identitytoken")
    fields = {name: entry.get(name) or "" for name in names}
    if not all(isinstance(value, str) for value in fields.values()):
        raise FetchError(f"the image pull secret's entry for {key} has a field that is not a string")
    username, password = fields["username"], fields["password"]
    if fields["auth"]:
        try:
            decoded = base64.b64decode(fields["auth"], validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            raise FetchError(
                f'the image pull secret\'s "auth" for {key} is not base64 of user:password'
            ) from None
        username, separator, password = decoded.partition(":")
        if not separator or not username:
            raise FetchError(f'the image pull secret\'s "auth" for {key} is not base64 of user:password')
        password = password.strip("\x00")
    return Credentials(username, password, fields["registrytoken"], fields["identitytoken"])
