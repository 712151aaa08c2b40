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


# -- bad input: "Error: …" and exit 1, never a traceback or a hang ----------------------------------------
def cluster_dump(cluster: dict[str, Any]) -> dict[str, Any]:
    return {"configs": [{"@type": CLUSTERS, "static_clusters": [{"cluster": {"name": "c", **cluster}}]}]}


def assert_refused(result: Result, *words: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.output.startswith("Error: "), result.output
    for word in words:
        assert word in result.output


@pytest.mark.parametrize("output", ["short", "json", "yaml"])
@pytest.mark.parametrize(
    "document",
    [
        '{"configs": [' + "1" * 5000 + "]}",
        "[" * 100_000 + "]" * 100_000,
        '{"configs": [NaN]}',
        '{"configs": [Infinity]}',
    ],
    ids=["bigint", "deep", "nan", "infinity"],
)
def test_documents_go_would_not_read_are_refused(tmp_path: Path, document: str, output: str) -> None:
    assert_refused(run(tmp_path, document, "cluster", "-o", output), "config dump")


@pytest.mark.parametrize("document", ["not json", "{", "[" * 100_000 + "]" * 100_000])
def test_all_yaml_of_what_is_not_json_is_an_error(tmp_path: Path, document: str) -> None:
    assert_refused(run(tmp_path, document, "all", "-o", "yaml"))


def test_all_yaml_of_an_empty_file_is_null_as_json_to_yaml(tmp_path: Path) -> None:
    result = run(tmp_path, "", "all", "-o", "yaml")
    assert result.exit_code == 0, result.output
    assert result.output == "null\n\n"


def test_a_struct_nested_too_deeply_for_python_is_refused(tmp_path: Path) -> None:
    nested: dict[str, Any] = {}
    for _ in range(900):
        nested = {"a": nested}
    for output in ("short", "json", "yaml"):
        result = run(
            tmp_path, cluster_dump({"metadata": {"filter_metadata": {"x": nested}}}), "cluster", "-o", output
        )
        assert_refused(result, "nested too deeply")


RBAC = "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC"


@pytest.mark.parametrize("key", ["abc", " 1", "1_0", "0x1", "9223372036854775808", "1.0"])
def test_an_int64_map_key_go_would_not_parse_is_refused(tmp_path: Path, key: str) -> None:
    # envoy.type.v3 ... CheckedExpr.reference_map is map<int64, Reference>
    policy = {
        "permissions": [{"any": True}],
        "principals": [{"any": True}],
        "checked_condition": {"reference_map": {key: {}}},
    }
    config = {"@type": RBAC, "stat_prefix": "x", "rules": {"policies": {"p": policy}}}
    document = tcp_listener(config)
    document["configs"][0]["static_listeners"][0]["listener"]["filter_chains"][0]["filters"][0]["name"] = (
        "rbac"
    )
    assert_refused(run(tmp_path, document, "listener", "-o", "json"), key.strip() or key)


def test_an_int64_map_key_go_parses_is_read(tmp_path: Path) -> None:
    policy = {
        "permissions": [{"any": True}],
        "principals": [{"any": True}],
        "checked_condition": {"reference_map": {"-12": {}, "+3": {}}},
    }
    config = {"@type": RBAC, "stat_prefix": "x", "rules": {"policies": {"p": policy}}}
    result = run(tmp_path, tcp_listener(config), "listener", "-o", "json")
    assert result.exit_code == 0, result.output
    assert '"-12": {}' in result.output and '"3": {}' in result.output


def test_yaml_key_order_counts_only_decimal_digits_as_go_yaml(tmp_path: Path) -> None:
    # go-yaml's keyList.Less: unicode.IsDigit (Nd) only; "²" is neither a letter nor a digit: a3 < a²? no:
    # at index 1, '3' and '²' are both non-letters; the digit run of "a²" is empty (0) < 3
    result = run(
        tmp_path,
        cluster_dump({"metadata": {"filter_metadata": {"x": {"a\u00b2": 1, "a3": 2}}}}),
        "cluster",
        "-o",
        "yaml",
    )
    assert result.exit_code == 0, result.output
    assert result.output.index("a²") < result.output.index("a3")


def test_yaml_key_order_reads_other_scripts_digits_as_go_yaml() -> None:
    from istio_agent.ctl.configdump import render

    # Arabic-Indic digit two (U+0662) is Nd: go-yaml takes it as rune-'0', a large number
    assert render._key_less("a9", "a\u0662")
    assert not render._key_less("a\u0662", "a9")


@pytest.mark.parametrize(
    ("output", "expected"), [("json", '"healthyPanicThreshold": {\n'), ("yaml", "value: NaN\n")]
)
def test_a_nan_string_in_a_double_field_prints_as_istioctl(
    tmp_path: Path, output: str, expected: str
) -> None:
    result = run(
        tmp_path,
        cluster_dump({"common_lb_config": {"healthy_panic_threshold": {"value": "NaN"}}}),
        "cluster",
        "-o",
        output,
    )
    assert result.exit_code == 0, result.output
    assert expected in result.output
    if output == "json":
        assert '"value": "NaN"' in result.output


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "value", ["1e999999999", "-1", "4294967296", "1e10", "NaN", " 1", "1_0", "0x10", "1.5"]
)
def test_uint32_values_out_of_go_range_are_refused(tmp_path: Path, value: str) -> None:
    result = run(
        tmp_path, cluster_dump({"per_connection_buffer_limit_bytes": value}), "cluster", "-o", "json"
    )
    assert_refused(result, value)


@pytest.mark.parametrize("value", ["4294967295", "1e3", 4294967295, 1.0e2])
def test_uint32_values_in_go_range_are_read(tmp_path: Path, value: Any) -> None:
    result = run(
        tmp_path, cluster_dump({"per_connection_buffer_limit_bytes": value}), "cluster", "-o", "json"
    )
    assert result.exit_code == 0, result.output


def test_a_port_beyond_uint32_is_refused(tmp_path: Path) -> None:
    endpoint = {
        "endpoint": {"address": {"socket_address": {"address": "1.2.3.4", "port_value": 99999999999999}}}
    }
    cluster = {"load_assignment": {"cluster_name": "x", "endpoints": [{"lb_endpoints": [endpoint]}]}}
    for output in ("short", "json", "yaml"):
        assert_refused(run(tmp_path, cluster_dump(cluster), "cluster", "-o", output), "99999999999999")


def test_an_endpoint_weight_beyond_uint32_is_refused(tmp_path: Path) -> None:
    status = {"address": {"envoy_internal_address": {"server_listener_name": "l"}}, "weight": 4294967296}
    document = {"cluster_statuses": [{"name": "c", "host_statuses": [status]}]}
    for output in ("short", "json", "yaml"):
        assert_refused(run(tmp_path, document, "endpoint", "-o", output), "4294967296")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("int32", 2147483648),
        ("int32", -2147483649),
        ("int64", "9223372036854775808"),
        ("uint64", "18446744073709551616"),
        ("uint64", -1),
    ],
)
def test_integer_ranges_are_gos(field: str, value: Any) -> None:
    from istio_agent.ctl.configdump import descriptors
    from istio_agent.ctl.configdump.messages import MessageError, read

    desc = descriptors.message(f"google.protobuf.{field.capitalize().replace('Uint', 'UInt')}Value")
    assert desc is not None
    with pytest.raises(MessageError):
        read(desc, value)


def test_a_double_beyond_float64_is_refused_but_infinity_is_read() -> None:
    from istio_agent.ctl.configdump import descriptors
    from istio_agent.ctl.configdump.messages import MessageError, read

    desc = descriptors.message("google.protobuf.DoubleValue")
    assert desc is not None
    with pytest.raises(MessageError):
        read(desc, "1e999")
    assert read(desc, "Infinity") == float("inf")


# -- zero enums -------------------------------------------------------------------------------------------
def test_a_zero_enum_is_left_out_unless_a_oneof_member(tmp_path: Path) -> None:
    # jsonpb leaves zero values out; Cluster.type is in the cluster_discovery_type oneof, lb_policy is not
    cluster = {"lb_policy": "ROUND_ROBIN", "type": "STATIC", "connect_timeout": "0s"}
    result = run(tmp_path, cluster_dump(cluster), "cluster", "-o", "json")
    assert result.exit_code == 0, result.output
    assert "lbPolicy" not in result.output
    assert '"type": "STATIC"' in result.output and '"connectTimeout": "0s"' in result.output
    result = run(tmp_path, cluster_dump({"lb_policy": 0}), "cluster", "-o", "json")
    assert "lbPolicy" not in result.output
    result = run(tmp_path, cluster_dump({"lb_policy": "RANDOM"}), "cluster", "-o", "json")
    assert '"lbPolicy": "RANDOM"' in result.output


# -- all: the tables before a missing section are printed, then istioctl's error -----------------------------
def test_all_prints_the_tables_before_a_missing_section(tmp_path: Path) -> None:
    golden = Path(__file__).parent / "testdata" / "istioctl" / "proxyconfig" / "config_dump.json"
    document = json.loads(golden.read_text())
    secrets = "type.googleapis.com/envoy.admin.v3.SecretsConfigDump"
    document["configs"] = [c for c in document["configs"] if c.get("@type") != secrets]
    full = CliRunner().invoke(main, ["proxy-config", "all", "-f", str(golden)]).output
    result = run(tmp_path, document, "all")
    assert result.exit_code == 1
    printed, _, error = result.output.partition("Error: ")
    assert error == f"config dump has no configuration type {secrets}\n"
    assert printed and full.startswith(printed)
    assert printed.rstrip("\n").splitlines()[-1].startswith("route/")
    assert printed.endswith("\n\n")
