"""What a module request carries to the cache (Istio's ``pkg/wasm/options.go``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PullPolicy(enum.Enum):
    """When a cached module is fetched again (the WasmPlugin's ``imagePullPolicy``)."""

    UNSPECIFIED = 0
    """As IF_NOT_PRESENT, except an ``oci://`` image tagged ``latest``, which is as ALWAYS."""
    IF_NOT_PRESENT = 1
    ALWAYS = 2
    """Fetched again when the plugin's resource version changes."""

    @classmethod
    def from_env_value(cls, value: str) -> PullPolicy:
        """The policy istiod names in ``ISTIO_META_WASM_IMAGE_PULL_POLICY``; unknown names are unspecified."""
        return _BY_NAME.get(value, cls.UNSPECIFIED)


_BY_NAME = {
    "UNSPECIFIED_POLICY": PullPolicy.UNSPECIFIED,
    "IfNotPresent": PullPolicy.IF_NOT_PRESENT,
    "Always": PullPolicy.ALWAYS,
}


@dataclass(frozen=True)
class GetOptions:
    checksum: str = ""
    """The module's sha256 (hex) as the plugin gives it; empty: whatever is fetched."""
    resource_name: str = ""
    """The ECDS resource (``<namespace>.<plugin>``) asking: resource versions are kept per resource."""
    resource_version: str = ""
    timeout: float = 5.0
    """Seconds for the whole fetch, retries included."""
    pull_secret: bytes | None = None
    """Docker config JSON for the registry (never logged)."""
    pull_policy: PullPolicy = PullPolicy.UNSPECIFIED

    def __repr__(self) -> str:
        secret = "<set>" if self.pull_secret else None
        return (
            f"GetOptions(checksum={self.checksum!r}, resource_name={self.resource_name!r}, "
            f"resource_version={self.resource_version!r}, timeout={self.timeout!r}, "
            f"pull_secret={secret}, pull_policy={self.pull_policy.name})"
        )
