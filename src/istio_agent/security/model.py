"""Types shared by the secret manager, the SDS server and the CA client."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

WORKLOAD_KEY_CERT = "default"
"""SDS resource name of the workload key and certificate chain."""
ROOT_CERT = "ROOTCA"
"""SDS resource name of the workload trust bundle."""


@dataclass(frozen=True)
class SecretItem:
    """One SDS secret: a key/chain pair, or a root bundle (``root_cert`` set, the rest empty)."""

    resource_name: str
    certificate_chain: bytes = b""
    private_key: bytes = b""
    root_cert: bytes = b""
    created: datetime | None = None
    expires: datetime | None = None

    @property
    def is_root(self) -> bool:
        return bool(self.root_cert) and not self.certificate_chain


class SecretError(Exception):
    """A secret could not be produced; the message says why (never contains key material)."""


class CAError(Exception):
    """The CA did not sign the CSR; ``code`` is the gRPC status (a ``rpc.Status``) when the call failed.

    The one failure a CA client reports: the secret manager retries on it, anything else is a bug.
    """

    def __init__(self, message: str, code: object = None) -> None:
        super().__init__(message)
        self.code = code


class SecretProvider(Protocol):
    """What the SDS server needs: produce a secret by resource name (cached, from files or the CA)."""

    async def generate(self, resource_name: str) -> SecretItem: ...


SecretUpdateCallback = Callable[[str], None]
"""Called with a resource name when that secret changed (rotation, file change, new root)."""
