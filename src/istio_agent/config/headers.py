"""gRPC metadata from env vars (``CA_HEADER_*``, ``XDS_HEADER_*``, ``ISTIO_META_CLUSTER_ID``), checked once.

gRPC refuses an unusable header only when a call is made, with a message that names neither the
header nor the variable; these checks run when the settings are read so start-up fails instead.
"""

from __future__ import annotations

import re

from istio_agent.config.env import ConfigError, Env

_NAME = re.compile(r"^[0-9a-z_.\-]+$")


def is_header_value(value: str) -> bool:
    """Whether gRPC sends ``value`` as an ASCII header value (printable ASCII, spaces allowed)."""
    return all(0x20 <= ord(c) < 0x7F for c in value)


def header_value_from_env(env: Env, variable: str) -> str:
    """The variable's text, refused when it cannot travel as a header value (e.g. the cluster id)."""
    value = env.text(variable)
    if not is_header_value(value):
        raise ConfigError(f"invalid value for {variable}: must be printable ASCII")
    return value


def headers_from_env(env: Env, prefix: str) -> dict[str, str]:
    """``<prefix><NAME>=v`` -> ``{"<name>": v}`` (gRPC lower-cases names on the wire, as Istio sends them).

    Names gRPC reserves (``grpc-*``) or treats as binary (``*-bin``) are refused along with any
    character outside lower-case letters, digits, ``_``, ``.`` and ``-``; values must be printable ASCII.
    """
    headers: dict[str, str] = {}
    for raw_name, value in sorted(env.with_prefix(prefix).items()):
        variable = f"{prefix}{raw_name}"
        name = raw_name.lower()
        if not _NAME.match(name) or name.startswith("grpc-") or name.endswith("-bin"):
            raise ConfigError(f"invalid value for {variable}: {name!r} cannot be used as a gRPC header name")
        if not is_header_value(value):
            raise ConfigError(f"invalid value for {variable}: header values must be printable ASCII")
        headers[name] = value
    return headers
