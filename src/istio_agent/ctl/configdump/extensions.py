"""``proxy-config ecds`` and ``bootstrap``: istioctl's ``ecds.go`` and the bootstrap half of ``configdump.go``."""

from __future__ import annotations

from typing import Any

from istio_agent.ctl.configdump import render
from istio_agent.ctl.configdump.gosort import sort_slice
from istio_agent.ctl.configdump.messages import Msg, jsonpb_text
from istio_agent.ctl.configdump.resources import dig, section_message, text
from istio_agent.ctl.configdump.source import ConfigDumpError, Dump
from istio_agent.goformat import tabwrite
from istio_agent.xds.types import TYPE_PREFIX

EXTENSION = "envoy.config.core.v3.TypedExtensionConfig"


def ecds_dump(dump: Dump) -> Msg:
    """Every ``EcdsConfigDump`` section's filters, in one ``EcdsConfigDump``."""
    filters: list[Any] = []
    for raw in dump.sections("EcdsConfigDump"):
        filters += section_message("EcdsConfigDump", raw).get("ecdsFilters") or []
    return Msg({"ecdsFilters": filters}) if filters else Msg()


def ecds_summary(dump: Dump) -> str:
    extensions = []
    for entry in ecds_dump(dump).get("ecdsFilters") or []:
        config = dig(entry, "ecdsFilter") or {}
        if config.get("@type") != TYPE_PREFIX + EXTENSION:
            url = config.get("@type")
            raise ConfigDumpError(f"failed to retrieve TypedExtensionConfig: mismatched message type {url}")
        extensions.append(config)

    def less(a: Any, b: Any) -> bool:
        a_url, b_url = text(a, "typedConfig", "@type"), text(b, "typedConfig", "@type")
        return text(a, "name") < text(b, "name") if a_url == b_url else a_url < b_url

    sort_slice(extensions, less)
    rows = [["ECDS NAME", "TYPE"]]
    rows += [[text(e, "name"), text(e, "typedConfig", "@type").removeprefix(TYPE_PREFIX)] for e in extensions]
    return tabwrite(rows, padding=5)


def ecds_output(dump: Dump, output: str) -> str:
    """protojson of the merged EcdsConfigDump, or its YAML."""
    text_json = render.protojson_text(ecds_dump(dump))
    return (render.json_to_yaml(text_json) if output == "yaml" else text_json) + "\n"


def bootstrap(dump: Dump) -> Msg:
    return section_message("BootstrapConfigDump", dump.section("BootstrapConfigDump"))


def bootstrap_output(dump: Dump, output: str) -> str:
    """jsonpb of the BootstrapConfigDump (indent four spaces, jsonpb's quirks), or its YAML."""
    text_json = jsonpb_text(bootstrap(dump))
    return (render.json_to_yaml(text_json) if output == "yaml" else text_json) + "\n"


def bootstrap_summary(dump: Dump) -> str:
    """Istio, Istio proxy and Envoy versions from the bootstrap's node (tabwriter padding 1)."""
    node = dig(bootstrap(dump), "bootstrap", "node")
    metadata = dig(node, "metadata") or {}
    rows = []
    version = _string_value(metadata.get("ISTIO_VERSION"))
    sha = _string_value(metadata.get("ISTIO_PROXY_SHA"))
    if ":" in sha:
        sha = sha.split(":")[1]
    if version:
        rows.append(["Istio Version:", version])
    if sha:
        rows.append(["Istio Proxy Version:", sha])
    rows.append(["Envoy Version:", _envoy_version(node)])
    return tabwrite(rows, padding=1)


def _string_value(value: Any) -> str:
    inner = getattr(value, "inner", None)
    return inner if isinstance(inner, str) else ""


def _envoy_version(node: Any) -> str:
    build = dig(node, "userAgentBuildVersion")
    version = dig(build, "version") or {}
    text_out = f"{version.get('majorNumber', 0)}.{version.get('minorNumber', 0)}.{version.get('patch', 0)}"
    metadata = dig(build, "metadata") or {}
    for key, mark in (
        ("build.label", "-"),
        ("revision.status", "/"),
        ("build.type", "/"),
        ("ssl.version", "/"),
    ):
        if key in metadata:
            text_out += mark + _string_value(metadata[key])
    return text_out
