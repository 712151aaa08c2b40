"""``agentctl proxy-config`` config-dump views against istioctl 1.28's goldens, byte for byte.

Each case is one of istioctl's own tests (``istioctl/pkg/writer/envoy/configdump/*_test.go`` and
``istioctl/pkg/proxyconfig/proxyconfig_test.go`` at ff49c188) with the same input and flags; the
goldens are copied unchanged into tests/ctl/testdata/istioctl (see its README.md).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from istio_agent.cli.agentctl import main
from istio_agent.ctl.configdump import render
from istio_agent.ctl.configdump.gosort import sort_slice
from istio_agent.ctl.configdump.routes import describe_route_domains
from istio_agent.goformat import tabwrite

GOLDEN = Path(__file__).parent / "testdata" / "istioctl"
CONFIGDUMP = GOLDEN / "configdump"


def agentctl(*args: str) -> str:
    result = CliRunner().invoke(main, ["proxy-config", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_all_summary_is_istiocls_proxy_config_all() -> None:
    # TestPrintProxyConfigSummary: istioctl proxy-config all -f testdata/config_dump.json
    got = agentctl("all", "-f", str(GOLDEN / "proxyconfig" / "config_dump.json"))
    assert got == (GOLDEN / "proxyconfig" / "config_dump_summary.txt").read_text()


@pytest.mark.parametrize("alias", ["all", "a"])
def test_all_json_prints_the_dump_itself(alias: str) -> None:
    dump = GOLDEN / "proxyconfig" / "config_dump.json"
    assert agentctl(alias, "-f", str(dump), "-o", "json") == dump.read_text() + "\n"


@pytest.mark.parametrize(
    "case", ["empty-gateway", "istio-gateway-http-route-prefix", "k8s-gateway-http-route-path-prefix"]
)
@pytest.mark.parametrize("alias", ["route", "routes", "r"])
def test_route_summary(case: str, alias: str) -> None:
    # TestPrintRoutesSummary (RouteFilter{Verbose: true}, the command's default)
    got = agentctl(alias, "-f", str(CONFIGDUMP / "routes" / case / "configdump.json"))
    assert got == (CONFIGDUMP / "routes" / case / "output.txt").read_text()


@pytest.mark.parametrize(("case", "flags"), [("emptyfilter", []), ("portfilter", ["--port", "8080"])])
@pytest.mark.parametrize("output", ["short", "json", "yaml"])
def test_eds_summary_and_dump(case: str, flags: list[str], output: str) -> None:
    # TestPrintEndpointsSummary / TestPrintEndpoints (configdump.EndpointFilter: istioctl's eds view)
    got = agentctl("eds", "-f", str(CONFIGDUMP / "endpoint" / "configdump.json"), "-o", output, *flags)
    suffix = {"short": "txt", "json": "json", "yaml": "yaml"}[output]
    assert got == (CONFIGDUMP / "endpoint" / f"{case}_output.{suffix}").read_text()


@pytest.mark.parametrize(
    ("output", "golden"), [("short", "output.txt"), ("json", "output.json"), ("yaml", "output.yaml")]
)
@pytest.mark.parametrize("alias", ["ecds", "ec"])
def test_ecds(output: str, golden: str, alias: str) -> None:
    # TestPrintEcdsSummary / TestPrintEcdsYaml / TestPrintEcdsJSON
    got = agentctl(alias, "-f", str(CONFIGDUMP / "ecds" / "configdump.json"), "-o", output)
    assert got == (CONFIGDUMP / "ecds" / golden).read_text()


@pytest.mark.parametrize("alias", ["bootstrap", "b"])
def test_bootstrap_dump_is_jsonpb_with_its_indentation(alias: str) -> None:
    # TestConfigWriter_PrintBootstrapDump: jsonpb's Struct indentation included
    got = agentctl(alias, "-f", str(CONFIGDUMP / "configdump.json"))
    assert got == (CONFIGDUMP / "bootstrapdump.json").read_text()


def test_bootstrap_short_is_the_version_summary() -> None:
    # TestConfigWriter_PrintVersionSummary
    got = agentctl("bootstrap", "-f", str(CONFIGDUMP / "configdump.json"), "-o", "short")
    assert got == (CONFIGDUMP / "versionsummary.txt").read_text()


@pytest.mark.parametrize(
    ("domains", "expected"),
    [
        ([], ""),
        (["example.com"], "example.com"),
        (["example.com", "example.com:8080"], "example.com"),
        (["example.com", "example.com:8080", "1.2.3.4", "1.2.3.4:8080"], "example.com, 1.2.3.4"),
        (
            ["example.com", "example.com:8080", "[fd00:10:96::7fc7]", "[fd00:10:96::7fc7]:8080"],
            "example.com, [fd00:10:96::7fc7]",
        ),
        (
            [
                "example.com",
                "example.com:8080",
                "www.example.com",
                "www.example.com:8080",
                "[fd00:10:96::7fc7]",
                "[fd00:10:96::7fc7]:8080",
            ],
            "example.com, www.example.com + 1 more...",
        ),
    ],
)
def test_describe_route_domains(domains: list[str], expected: str) -> None:
    # TestDescribeRouteDomains
    assert describe_route_domains(domains) == expected


def test_table_keeps_the_padding_before_an_empty_last_cell() -> None:
    assert tabwrite([["A", "B"], ["long", ""]], padding=5) == "A        B\nlong     \n"


def test_go_sort_sorts_like_any_sort_for_a_total_order() -> None:
    rng = random.Random(7)
    for size in range(0, 300, 7):
        items = [rng.randint(0, 40) for _ in range(size)]
        got = list(items)
        sort_slice(got, lambda a, b: a < b)
        assert got == sorted(items)


def test_yaml_quotes_what_go_yaml_would_read_as_another_type() -> None:
    text = render.json_to_yaml('{"b": "1605", "a": "yes", "c": "", "d": "10.0.0.1", "e2": 1, "e10": 1.5}')
    assert text == 'a: "yes"\nb: "1605"\nc: ""\nd: 10.0.0.1\ne2: 1\ne10: 1.5\n'


def test_missing_section_is_istioctls_error(tmp_path: Path) -> None:
    dump = tmp_path / "dump.json"
    dump.write_text('{"configs": []}')
    result = CliRunner().invoke(main, ["proxy-config", "cluster", "-f", str(dump)])
    assert result.exit_code == 1
    assert (
        "config dump has no configuration type type.googleapis.com/envoy.admin.v3.ClustersConfigDump"
        in result.output
    )


@pytest.mark.parametrize("view", ["listener", "route"])
def test_verbose_takes_istioctls_bool_flag_forms(view: str) -> None:
    dump = str(GOLDEN / "proxyconfig" / "config_dump.json")
    full = agentctl(view, "-f", dump)
    assert agentctl(view, "-f", dump, "--verbose") == full
    assert agentctl(view, "-f", dump, "--verbose=true") == full
    brief = agentctl(view, "-f", dump, "--verbose=false")
    assert brief != full and brief == agentctl(view, "-f", dump, "--verbose=0")
