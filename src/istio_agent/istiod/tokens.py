"""Token sources (Istio's credential fetchers): the bearer token the agent shows the CA and istiod.

The projected Kubernetes token is rotated by the kubelet, so the file is read on every call. A token
that cannot be read is not an error: the call goes out without one (``istiod/dial.py`` says so in
the caller's log scope), because a client certificate (PROV_CERT) may still authenticate it, and
the CA's own rejection is the clearer message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from istio_agent.config import ConfigError, SecuritySettings

MOCK_TOKEN = "test_token"
FILE_JWT_POLICIES = ("third-party-jwt", "first-party-jwt")


class TokenSource(Protocol):
    """Produces the current bearer token; ``""`` means "send no token".

    ``token()`` may raise OSError when the credential cannot be fetched; ``str(source)`` names the
    source in logs (a file path, never the token).
    """

    def token(self) -> str: ...


class FileTokenSource:
    """A token read from a file on every call (the kubelet rotates projected tokens in place).

    A file that cannot be read raises OSError and is not logged here: the source is shared by the
    CA client and the xDS proxy, and each says so once, in its own log scope (``istiod/dial.py``).
    Bytes that are not UTF-8 become U+FFFD, which no header may hold, so such a token is not sent.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def token(self) -> str:
        return self.path.read_bytes().decode("utf-8", errors="replace").strip()

    def __str__(self) -> str:
        return f"token file {self.path}"

    def __repr__(self) -> str:
        return f"FileTokenSource({str(self.path)!r})"


class StaticTokenSource:
    """A fixed token (the ``Mock`` credential fetcher, tests)."""

    def __init__(self, value: str) -> None:
        self._value = value

    def token(self) -> str:
        return self._value

    def __str__(self) -> str:
        return "the static token"

    def __repr__(self) -> str:
        # Never show the value: even a static token is a credential.
        return "StaticTokenSource(<redacted>)"


def token_source_for(settings: SecuritySettings) -> TokenSource | None:
    """The token source selected by CREDENTIAL_FETCHER_TYPE and JWT_POLICY, or None for no token."""
    fetcher = settings.credential_fetcher_type
    if fetcher in ("JWT", ""):
        if settings.jwt_policy in FILE_JWT_POLICIES:
            return FileTokenSource(settings.token_path)
        return None
    if fetcher == "Mock":
        return StaticTokenSource(MOCK_TOKEN)
    raise ConfigError(f"invalid value for CREDENTIAL_FETCHER_TYPE: invalid credential fetcher type {fetcher}")
