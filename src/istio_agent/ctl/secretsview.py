"""How ``agentctl proxy-config secret`` prints: istioctl's tables and JSON, then our extra columns.

The default table is byte for byte istioctl's (``istioctl/pkg/writer/envoy/configdump/secret.go``:
tabwriter padding 5), so scripts written for istioctl keep working; ``verbose`` appends our columns
(EXPIRES relative to now, CHAIN) after istioctl's. The diff table and the item JSON are istioctl's
SDS writer (``istioctl/pkg/writer/compare/sds/writer.go``), whose NODE AGENT column prints the
item's Source.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from istio_agent.ctl.secrets import FileCheck, SecretItem, SecretItemDiff, expiry_text
from istio_agent.goformat import json_marshal, tabwrite

PADDING = 5
SUMMARY_COLUMNS = [
    "RESOURCE NAME",
    "TYPE",
    "STATUS",
    "VALID CERT",
    "SERIAL NUMBER",
    "NOT AFTER",
    "NOT BEFORE",
]
DIFF_COLUMNS = [
    "RESOURCE NAME",
    "TYPE",
    "VALID CERT",
    "NODE AGENT",
    "PROXY",
    "SERIAL NUMBER",
    "NOT AFTER",
    "NOT BEFORE",
]
FILE_COLUMNS = ["FILE", "RESOURCE NAME", "SERIAL NUMBER", "MD5", "ENVOY"]
NO_ITEMS = "No secret items to show.\n"
NO_DIFFS = "No secrets found to diff.\n"
NO_DYNAMIC = "No active or warming secrets found.\n"


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _chain(item: SecretItem) -> str:
    if item.chain_verified is None:
        return "-"
    return "verified" if item.chain_verified else "NOT VERIFIED"


def summary_table(items: list[SecretItem], *, now: datetime, verbose: bool = False) -> str:
    """istioctl's secret summary; TRUST DOMAIN when every item has one; EXPIRES and CHAIN when verbose."""
    if not items:
        return NO_ITEMS
    with_domain = all(item.trust_domain for item in items)
    header = [
        *SUMMARY_COLUMNS,
        *(["TRUST DOMAIN"] if with_domain else []),
        *(["EXPIRES", "CHAIN"] if verbose else []),
    ]
    rows = [header]
    for item in items:
        row = [
            item.name,
            item.type,
            item.state,
            _bool(item.valid),
            item.serial_number,
            item.not_after,
            item.not_before,
        ]
        if with_domain:
            row.append(item.trust_domain)
        if verbose:
            row += [expiry_text(item, now), _chain(item)]
        rows.append(row)
    return tabwrite(rows, padding=PADDING)


def diff_table(rows: list[SecretItemDiff], *, now: datetime, verbose: bool = False) -> str:
    """istioctl's SecretItemDiff table (NODE AGENT shows Source); EXPIRES appended when verbose."""
    if not rows:
        return NO_DIFFS
    lines = [[*DIFF_COLUMNS, *(["EXPIRES"] if verbose else [])]]
    for row in rows:
        item = row.item
        line = [
            item.name,
            item.type,
            _bool(item.valid),
            item.source,
            row.proxy,
            item.serial_number,
            item.not_after,
            item.not_before,
        ]
        if verbose:
            line.append(expiry_text(item, now))
        lines.append(line)
    return tabwrite(lines, padding=PADDING)


def files_table(checks: list[FileCheck]) -> str:
    """The agent's certificate files against Envoy (beyond istioctl); empty when the agent has none."""
    if not checks:
        return ""
    rows = [FILE_COLUMNS]
    rows += [[c.path, c.resource_name, c.serial_number, c.md5, c.envoy] for c in checks]
    return tabwrite(rows, padding=PADDING)


def go_json(value: Any, indent: str = " ") -> str:
    """Go's ``json.MarshalIndent(value, "", indent)`` of istioctl's structs (field order kept)."""
    return json_marshal(value, indent)


def items_json(items: list[SecretItem]) -> str:
    """istioctl's SDS writer JSON of secret items (one-space indent), with our fields appended."""
    return go_json([item.as_json() for item in items])


def diff_document(rows: list[SecretItemDiff], checks: list[FileCheck]) -> dict[str, Any]:
    """The comparison: istioctl's SecretItemDiff list under ``secrets``, the file checks under ``files``."""
    return {"secrets": [row.as_json() for row in rows], "files": [c.as_json() for c in checks]}


def dump_json(section: dict[str, Any]) -> str:
    """istioctl's ``-o json``: the SecretsConfigDump as ``protomarshal.ToJSONWithIndent`` writes it
    (golang/protobuf's jsonpb: lowerCamel names, four-space indent, no ``@type`` at the top)."""
    from istio_agent.ctl.configdump.messages import jsonpb_text
    from istio_agent.ctl.configdump.resources import section_message

    return jsonpb_text(section_message("SecretsConfigDump", section))


def dump_yaml(section: dict[str, Any]) -> str:
    """istioctl's ``-o yaml``: the same document through ``sigs.k8s.io/yaml.JSONToYAML``."""
    from istio_agent.ctl.configdump.render import json_to_yaml

    return json_to_yaml(dump_json(section))


def document_yaml(document: dict[str, Any]) -> str:
    """Our own documents (the comparison) as YAML, by the same JSON-to-YAML rules as istioctl's."""
    from istio_agent.ctl.configdump.render import json_to_yaml

    return json_to_yaml(json.dumps(document))
