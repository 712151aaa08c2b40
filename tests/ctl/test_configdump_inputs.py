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


# -- --verbose: a Go bool flag (pflag) ---------------------------------------------------------------
def static_listener_dump() -> dict[str, Any]:
    return tcp_listener({"@type": TCP_PROXY, "stat_prefix": "x", "cluster": "outbound|80||a.b"})


@pytest.mark.parametrize("view", ["listener", "route", "all"])
def test_a_word_after_verbose_stays_positional(tmp_path: Path, view: str) -> None:
    # pflag: a bool flag takes a value only as --verbose=VALUE; the next word is the admin address
    result = run(tmp_path, static_listener_dump(), view, "--verbose", "127.0.0.1:1")
    assert "give either an admin address or -f FILE" in result.output
    result = run(tmp_path, static_listener_dump(), view, "--verbose", "false")
    assert "give either an admin address or -f FILE" in result.output


@pytest.mark.parametrize(
    "value", ["1", "t", "T", "TRUE", "true", "True", "0", "f", "F", "FALSE", "false", "False"]
)
def test_verbose_takes_go_parse_bool_values(tmp_path: Path, value: str) -> None:
    result = run(tmp_path, static_listener_dump(), "listener", f"--verbose={value}")
    assert result.exit_code == 0, result.output
    verbose = value in ("1", "t", "T", "TRUE", "true", "True")
    assert result.output.split()[2] == ("MATCH" if verbose else "TYPE")


@pytest.mark.parametrize("value", ["yes", "on", "y", " true", "", "tRUE"])
def test_verbose_refuses_what_go_parse_bool_refuses(tmp_path: Path, value: str) -> None:
    result = run(tmp_path, static_listener_dump(), "listener", f"--verbose={value}")
    assert result.exit_code != 0
    assert f'invalid argument "{value}" for "--verbose" flag' in result.output
