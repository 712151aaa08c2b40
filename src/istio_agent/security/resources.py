"""SDS resource names that point at files: ``file-cert:<cert>~<key>`` and ``file-root:<ca>``."""

from __future__ import annotations

from dataclasses import dataclass

from istio_agent.security.model import ROOT_CERT

FILE_CERT_PREFIX = "file-cert:"
FILE_ROOT_PREFIX = "file-root:"
SEPARATOR = "~"
SYSTEM_ROOT = "system"
"""``file-root:system`` names the OS CA bundle; the caller maps it to the bundle's path."""
FILE_ROOT_SYSTEM = FILE_ROOT_PREFIX + SYSTEM_ROOT


@dataclass(frozen=True)
class FileResource:
    """Files behind a ``file-*`` resource: a key/cert pair or a root bundle."""

    cert_path: str = ""
    key_path: str = ""
    ca_path: str = ""

    @property
    def is_key_cert(self) -> bool:
        return bool(self.cert_path) and bool(self.key_path)

    @property
    def is_root(self) -> bool:
        return bool(self.ca_path)

    @property
    def resource_name(self) -> str:
        """The SDS name for these files; "" when they are neither a key/cert pair nor a root."""
        if self.is_key_cert:
            return f"{FILE_CERT_PREFIX}{self.cert_path}{SEPARATOR}{self.key_path}"
        if self.is_root:
            return f"{FILE_ROOT_PREFIX}{self.ca_path}"
        return ""


def parse_file_resource(name: str) -> FileResource | None:
    """The files named by a ``file-cert:``/``file-root:`` resource; None for any other name.

    Istio silently serves nothing for a malformed file name (and crashes later); we raise
    ValueError saying what is wrong instead.
    """
    if name.startswith(FILE_CERT_PREFIX):
        parts = name[len(FILE_CERT_PREFIX) :].split(SEPARATOR)
        if len(parts) != 2:
            raise ValueError(
                f"invalid resource name {name!r}: expected {FILE_CERT_PREFIX}<cert path>{SEPARATOR}<key "
                f"path> with exactly one {SEPARATOR!r}, found {len(parts) - 1}"
            )
        cert_path, key_path = parts
        if not cert_path or not key_path:
            missing = "certificate" if not cert_path else "key"
            raise ValueError(f"invalid resource name {name!r}: empty {missing} path")
        return FileResource(cert_path=cert_path, key_path=key_path)
    if name.startswith(FILE_ROOT_PREFIX):
        path = name[len(FILE_ROOT_PREFIX) :]
        if SEPARATOR in path:
            raise ValueError(
                f"invalid resource name {name!r}: {FILE_ROOT_PREFIX} takes a single path, "
                f"without {SEPARATOR!r}"
            )
        if not path:
            raise ValueError(f"invalid resource name {name!r}: empty root certificate path")
        return FileResource(ca_path=path)
    return None


def is_root_resource_name(name: str) -> bool:
    """Whether a name asks for a trust bundle (``ROOTCA`` or any ``file-root:`` name)."""
    return name == ROOT_CERT or name.startswith(FILE_ROOT_PREFIX)
