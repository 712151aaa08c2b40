"""The Envoy, xDS and UDPA message types, by full name, for reading a config dump field by field.

istioctl links every Envoy type in; the Python equivalent is importing every generated module of the
``envoy``, ``xds``, ``udpa`` and ``validate`` packages once (about 640 modules, well under a second),
so that an ``Any`` of any Envoy type in a dump can be read with its descriptor.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor

PACKAGES = ("envoy", "xds", "udpa", "validate")


@cache
def _load() -> None:
    for name in PACKAGES:
        try:
            package = importlib.import_module(name)
        except ImportError:
            continue
        for module in pkgutil.walk_packages(package.__path__, f"{name}."):
            if module.name.endswith("_pb2"):
                try:
                    importlib.import_module(module.name)
                except Exception:  # a module that fails to load leaves its types unknown, as in Go
                    continue


def message(full_name: str) -> Descriptor | None:
    """The descriptor of ``full_name`` (``envoy.config.cluster.v3.Cluster``), or None when unknown."""
    _load()
    try:
        return descriptor_pool.Default().FindMessageTypeByName(full_name)
    except KeyError:
        return None


def by_url(type_url: str) -> Descriptor | None:
    """The descriptor an ``Any``'s type URL names (the part after the last ``/``)."""
    return message(type_url.rsplit("/", 1)[-1])
