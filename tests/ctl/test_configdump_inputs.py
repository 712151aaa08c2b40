"""``agentctl proxy-config`` on inputs istioctl's goldens do not cover: Struct-bearing listeners,
malformed or hostile documents (each an ``Error: …`` and exit 1, never a traceback or a hang), the
``--verbose`` flag's pflag forms, zero enums, and ``all`` with a missing section."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from istio_agent.cli.agentctl import main

LISTENERS = "type.googleapis.com/envoy.admin.v3.ListenersConfigDump"
CLUSTERS = "type.googleapis.com/envoy.admin.v3.ClustersConfigDump"
TCP_PROXY = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"


def run(tmp_path: Path, document: Any, *args: str) -> Result:
    """agentctl proxy-config ARGS -f FILE, FILE holding ``document`` (text as is, else as JSON)."""
    dump = tmp_path / "dump.json"
    dump.write_text(document if isinstance(document, str) else json.dumps(document))
    return CliRunner().invoke(main, ["proxy-config", *args, "-f", str(dump)])


def tcp_listener(typed_config: dict[str, Any]) -> dict[str, Any]:
    listener = {
        "name": "l",
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": 80}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": typed_config}]}
        ],
    }
    return {"configs": [{"@type": LISTENERS, "static_listeners": [{"listener": listener}]}]}


JSON_ACCESS_LOG = {
    "@type": TCP_PROXY,
    "stat_prefix": "x",
    "cluster": "outbound|80||a.b",
    "access_log": [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": "/dev/stdout",
                "log_format": {"json_format": {"start_time": "%START_TIME%"}},
            },
        }
    ],
}
METADATA_MATCH = {
    "@type": TCP_PROXY,
    "stat_prefix": "x",
    "cluster": "outbound|80||a.b",
    "metadata_match": {"filter_metadata": {"envoy.lb": {"version": "v1"}}},
}


@pytest.mark.parametrize("config", [JSON_ACCESS_LOG, METADATA_MATCH], ids=["json_format", "metadata_match"])
@pytest.mark.parametrize("verbose", ["--verbose=true", "--verbose=false"])
def test_tcp_listener_with_a_struct_is_listed(tmp_path: Path, config: dict[str, Any], verbose: str) -> None:
    result = run(tmp_path, tcp_listener(config), "listener", verbose)
    assert result.exit_code == 0, result.output
    assert "Cluster: outbound|80||a.b" in result.output or "TCP" in result.output.splitlines()[1]


def test_blackhole_in_a_struct_string_is_found(tmp_path: Path) -> None:
    # istioctl looks for "BlackHoleCluster" in the TCP proxy's bytes: a Struct's strings are among them
    config = dict(
        METADATA_MATCH, cluster="x", metadata_match={"filter_metadata": {"k": {"v": "BlackHoleCluster"}}}
    )
    result = run(tmp_path, tcp_listener(config), "listener", "--verbose=false")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1].split()[-1] == "UNKNOWN"
