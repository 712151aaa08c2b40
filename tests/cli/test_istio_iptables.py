"""``pilot-agent istio-iptables``: Go-style flags and env in, the rule set out with --dry-run, 255 on errors.

Only --dry-run here: applying runs in a network namespace (tests/cni/test_istio_iptables_netns.py),
never in the test process's own, which is the machine's."""

from __future__ import annotations

from pathlib import Path

import pytest

from istio_agent.cni.capture_config import CaptureConfig, read_capture_config, usable_dns_servers
from istio_agent.cni.rules import render_families
from istio_agent.config.env import ConfigError, Env
from tests.cli.invoke import pilot_agent

ISTIO_GOLDENS = Path(__file__).parent.parent / "cni" / "golden"
"""Istio's own files (tests/cni/golden/ISTIO_SOURCES)."""
ISTIO_INIT = ["-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-x", "", "-b", "*"]
ISTIO_INIT += ["-d", "15090,15021,15020", "--log_output_level=default:info"]


def injector_rules() -> str:
    """What istio-init's args must print: the builder's rules for their config (the builder itself
    is compared with Istio's own goldens in tests/cni/test_rules.py)."""
    config = CaptureConfig(
        inbound_ports=("*",), inbound_ports_exclude=(15090, 15021, 15020), ip_ranges_include=("*",)
    )
    return render_families(config)[0]


def invoke(*args: str, **env: str) -> tuple[int, str, str]:
    """``pilot-agent istio-iptables <args>`` in this process (the tests patch what it would run)."""
    return pilot_agent("istio-iptables", *args, **env)


def test_dry_run_prints_the_injectors_rule_set() -> None:
    code, out, err = invoke(*ISTIO_INIT, "--dry-run")
    assert (code, err) == (0, "")
    assert out == injector_rules()


def test_long_flags_with_equals_and_env_give_the_same_rules() -> None:
    code, out, _ = invoke(
        "--envoy-port=15001",
        "--istio-service-cidr=*",
        "--istio-inbound-ports=*",
        "--istio-local-exclude-ports=15090,15021,15020",
        DRY_RUN="true",
        PROXY_UID="1337",
    )
    assert code == 0
    assert out == injector_rules()


def test_dual_stack_prints_both_families() -> None:
    code, out, _ = invoke(*ISTIO_INIT, "--dry-run", "--dual-stack")
    assert code == 0
    assert out.count("* nat") == 2
    assert "-A ISTIO_OUTPUT -o lo -s ::6/128 -j RETURN" in out


def test_skip_rule_apply_does_nothing() -> None:
    assert invoke(*ISTIO_INIT, "--skip-rule-apply") == (0, "", "")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["-p", "15x01"], {}, "invalid value '15x01' for --envoy-port: not a port number"),
        (["-z", "70000"], {}, "for --inbound-capture-port: must be between 1 and 65535"),
        (["-m", "NAT"], {}, "must be REDIRECT or TPROXY"),
        (["-i", "10.0.0.0"], {}, "'10.0.0.0' is not a CIDR"),
        (["-x", "10.0.0.300/8"], {}, "for --istio-service-exclude-cidr"),
        (["-x", "*"], {}, "OUTBOUND_IP_RANGES_EXCLUDE"),
        (["-x", "fe80::1%lo/64"], {}, "a zone cannot be part of a CIDR"),
        (["-u", "envoy"], {}, "'envoy' is not a numeric id"),
        (["--bogus"], {}, "No such option '--bogus'"),
        (["--probe-timeout", "5"], {}, "invalid value '5' for --probe-timeout"),
        (["--iptables-probe-port", "0"], {}, "invalid value '0' for --iptables-probe-port"),
        ([], {"INBOUND_CAPTURE_PORT": "0"}, "invalid value '0' for INBOUND_CAPTURE_PORT"),
        ([], {"DUAL_STACK": "yes"}, "invalid value for DUAL_STACK"),
        ([], {"ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR": "10.0.0.1/32"}, "not an IPv4 loopback CIDR"),
        (
            [],
            {"ISTIO_OUTBOUND_OWNER_GROUPS": "java", "ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE": "ftp"},
            "only one of",
        ),
    ],
)
def test_bad_flags_and_env_exit_255(args: list[str], env: dict[str, str], message: str) -> None:
    code, out, err = invoke("--dry-run", *args, **env)
    assert (code, out) == (255, "")
    assert err.startswith("Error: ")
    assert message in err


def test_gid_defaults_to_the_uid_and_flags_beat_env() -> None:
    env = Env({"INBOUND_CAPTURE_PORT": "17006"})
    config = read_capture_config({"proxy-uid": "3,4", "inbound-capture-port": "16006"}, env)
    assert (config.proxy_uid, config.proxy_gid, config.inbound_capture_port) == (
        ("3", "4"),
        ("3", "4"),
        16006,
    )


def test_envoy_port_has_no_env_var() -> None:
    """root.go binds --envoy-port with flag.Bind, not BindEnv: ENVOY_PORT never moves the redirect."""
    assert read_capture_config({}, Env({"ENVOY_PORT": "17001"})).proxy_port == 15001


def test_agent_wide_env_turns_on_dns_capture() -> None:
    assert read_capture_config({}, Env({"ISTIO_META_DNS_CAPTURE": "true"})).redirect_dns
    assert not read_capture_config(
        {}, Env({"ISTIO_META_DNS_CAPTURE": "true", "REDIRECT_DNS": "false"})
    ).redirect_dns


def test_trailing_commas_are_ignored() -> None:
    config = read_capture_config({"istio-local-outbound-ports-exclude": "6000,7000,"}, Env({}))
    assert config.outbound_ports_exclude == (6000, 7000)


def test_bad_bool_names_its_source() -> None:
    with pytest.raises(ConfigError, match="CAPTURE_ALL_DNS"):
        read_capture_config({}, Env({"CAPTURE_ALL_DNS": "maybe"}))


def test_dns_capture_from_the_agent_wide_env() -> None:
    code, out, _ = invoke(*ISTIO_INIT, "--dry-run", "--capture-all-dns", ISTIO_META_DNS_CAPTURE="true")
    assert code == 0
    assert "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -j REDIRECT --to-port 15053" in out
    assert "-A ISTIO_INBOUND -p udp --sport 53 -j CT --zone 1" in out


def test_only_plain_addresses_from_resolv_conf_become_rules() -> None:
    assert usable_dns_servers(["10.0.0.10", "fe80::1%eth0", "::1", "dns.example"]) == ("10.0.0.10", "::1")


# The 1.28 injection template (manifests/charts/istio-control/istio-discovery/files/injection-template.yaml)
# renders these for istio-init with global.proxy_init.forceApplyIptables and global.nativeNftables on,
# and for istio-validation (pilot.cni.enabled) with global.nativeNftables on.
TEMPLATE_INIT = [*ISTIO_INIT, "--force-apply", "--native-nftables"]
TEMPLATE_VALIDATION = [*ISTIO_INIT, "--run-validation", "--skip-rule-apply", "--native-nftables"]


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, object]]:
    """What the command would run with, instead of running it (it would apply in this namespace)."""
    from istio_agent.cni import command

    seen: list[tuple[object, object]] = []

    def record(config: object, mode: object, env: object) -> int:
        seen.append((config, mode))
        return 0

    monkeypatch.setattr(command, "run", record)
    return seen


@pytest.mark.parametrize("args", [TEMPLATE_INIT, TEMPLATE_VALIDATION], ids=["istio-init", "istio-validation"])
def test_the_injection_templates_args_are_accepted(
    args: list[str], runs: list[tuple[object, object]]
) -> None:
    """Issue 21: --force-apply and --native-nftables were refused by the parser (exit 255): no pod started."""
    code, _, err = invoke(*args)
    assert (code, err) == (0, "")
    _, mode = runs[0]
    assert mode.native_nftables  # type: ignore[attr-defined]
    assert mode.force_apply is (args is TEMPLATE_INIT)  # type: ignore[attr-defined]


def test_every_flag_of_istio_1_28_is_in_the_table() -> None:
    """tools/istio-iptables/pkg/cmd/root.go @1.28.10: the long names, with their short ones."""
    from istio_agent.cni.capture_config import FLAGS

    istio = {
        "envoy-port": "p", "inbound-capture-port": "z", "inbound-tunnel-port": "e", "proxy-uid": "u",
        "proxy-gid": "g", "istio-inbound-interception-mode": "m", "istio-inbound-ports": "b",
        "istio-local-exclude-ports": "d", "istio-exclude-interfaces": "c", "istio-service-cidr": "i",
        "istio-service-exclude-cidr": "x", "istio-outbound-ports": "q", "istio-local-outbound-ports-exclude": "o",
        "kube-virt-interfaces": "k", "istio-inbound-tproxy-mark": "t", "istio-inbound-tproxy-route-table": "r",
        "dry-run": "n", "iptables-probe-port": "", "probe-timeout": "", "skip-rule-apply": "",
        "run-validation": "", "redirect-dns": "", "drop-invalid": "", "dual-stack": "", "capture-all-dns": "",
        "network-namespace": "", "cni-mode": "", "reconcile": "", "cleanup-only": "", "force-apply": "",
        "native-nftables": "", "force-iptables-binary": "",
    }  # fmt: skip
    assert {flag.name: flag.short for flag in FLAGS} == istio


@pytest.mark.parametrize(
    ("args", "env", "field", "value"),
    [
        (["--network-namespace", "/var/run/netns/pod"], {}, "network_namespace", Path("/var/run/netns/pod")),
        ([], {"NETWORK_NAMESPACE": "/proc/42/ns/net"}, "network_namespace", Path("/proc/42/ns/net")),
        (["--cni-mode"], {}, "cni_mode", True),
        ([], {"CNI_MODE": "true"}, "cni_mode", True),
        (["--reconcile"], {}, "reconcile", True),
        ([], {"FORCE_APPLY": "1"}, "force_apply", True),
        ([], {"NATIVE_NFTABLES": "true"}, "native_nftables", True),
        (["--force-iptables-binary", "legacy"], {}, "iptables_binary", "legacy"),
        ([], {"FORCE_IPTABLES_BINARY": "nft"}, "iptables_binary", "nft"),
        (["--force-iptables-binary=nft"], {"FORCE_IPTABLES_BINARY": "legacy"}, "iptables_binary", "nft"),
        (["--cni-mode=false"], {"CNI_MODE": "true"}, "cni_mode", False),
        (["--force-apply=true"], {}, "force_apply", True),
    ],
)
def test_the_new_flags_and_their_env(
    args: list[str], env: dict[str, str], field: str, value: object, runs: list[tuple[object, object]]
) -> None:
    code, _, err = invoke(*args, **env)
    assert (code, err) == (0, "")
    assert getattr(runs[0][1], field) == value


def test_a_boolean_flag_takes_go_values_and_beats_its_env() -> None:
    """pflag takes --dry-run=false; click's flags took no value (exit 255)."""
    code, out, err = invoke(*ISTIO_INIT, "--dry-run=true")
    assert (code, err) == (0, "")
    assert out == injector_rules()
    assert invoke(*ISTIO_INIT, "-n=false", "--skip-rule-apply", DRY_RUN="true") == (0, "", "")
    code, _, err = invoke(*ISTIO_INIT, "--dry-run=maybe")
    assert code == 255
    assert "invalid value for --dry-run: invalid boolean 'maybe'" in err


def test_force_iptables_binary_is_legacy_or_nft() -> None:
    code, _, err = invoke(*ISTIO_INIT, "--force-iptables-binary", "nftables")
    assert code == 255
    assert "invalid value 'nftables' for --force-iptables-binary: must be legacy or nft" in err
    code, _, err = invoke(*ISTIO_INIT, FORCE_IPTABLES_BINARY="iptables")
    assert "for FORCE_IPTABLES_BINARY" in err


def test_native_nftables_dry_run_prints_istios_nftables_transaction() -> None:
    """Istio's tools/istio-nftables golden kube-virt-interfaces (tests/cni/golden/nftables/README.md)."""
    code, out, err = invoke("--native-nftables", "--dry-run", "-k", "eth1,eth2", "-i", "*")
    assert (code, err) == (0, "")
    assert out == (ISTIO_GOLDENS / "nftables" / "kube-virt-interfaces.golden").read_text()
