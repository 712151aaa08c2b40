"""Applying the rule set for real, in fresh network namespaces, with iptables-legacy and iptables-nft."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from istio_agent.cni import apply as apply_module
from istio_agent.cni.apply import ApplyError, apply_capture, expected_portion, istio_portion
from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.iptables import Backend, Tables, parse_save, probe
from istio_agent.cni.netns import CommandError, Deadline, addresses, ipv6_enabled
from istio_agent.cni.rules import BUILTIN, Rule, RuleSet, build
from tests.cni.netns import Netns, needs_root, netns, pod_and_peer

pytestmark = needs_root
ISTIO_INIT = CaptureConfig(
    inbound_ports=("*",), inbound_ports_exclude=(15090, 15021, 15020), ip_ranges_include=("*",)
)
RICH = CaptureConfig(
    mode="TPROXY",
    inbound_ports=("*",),
    inbound_ports_exclude=(15020,),
    ip_ranges_include=("10.0.0.0/8",),
    ip_ranges_exclude=("10.96.0.1/32",),
    exclude_interfaces=("eth9",),
    reroute_interfaces=("eth8",),
    outbound_ports_exclude=(5555,),
    redirect_dns=True,
    capture_all_dns=True,
    drop_invalid=True,
)


@pytest.fixture(params=["legacy", "nft"])
def backend(request: pytest.FixtureRequest) -> Backend:
    try:
        return probe(request.param)
    except CommandError as err:
        pytest.skip(f"iptables-{request.param} is not usable here: {err}")


@pytest.fixture
def pod() -> Iterator[Netns]:
    with netns() as space:
        yield space


@pytest.fixture
def restores(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every restore input written, in order (the real restore still runs)."""
    written: list[str] = []
    real = Backend.restore

    def counting(self: Backend, family: str, text: str, **kwargs: object) -> None:
        written.append(text)
        real(self, family, text, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Backend, "restore", counting)
    return written


def state(backend: Backend, space: Netns, family: str = "v4") -> Tables:
    """The namespace's rules, with empty built-in chains and tables left out (legacy shows no table
    until first used, nft keeps an emptied one: both mean "no rules")."""
    tables = parse_save(backend.save(family, netns=space.path))
    out: Tables = {}
    for table, chains in tables.items():
        kept = {chain: rules for chain, rules in chains.items() if rules or chain not in BUILTIN}
        if kept:
            out[table] = kept
    return out


def expected(backend: Backend, config: CaptureConfig, family: str = "v4") -> Tables:
    return expected_portion(backend, family, getattr(build(config), family), deadline=Deadline())


def istio_chains(tables: Tables) -> list[str]:
    return [chain for chains in tables.values() for chain in chains if chain.startswith("ISTIO_")]


def test_first_apply_writes_the_rules_and_an_identical_rerun_executes_nothing(
    backend: Backend, pod: Netns, restores: list[str]
) -> None:
    first = apply_capture(ISTIO_INIT, netns=pod.path, backend=backend)
    assert (first.action, len(restores)) == ("applied", 1)
    after = state(backend, pod)
    assert after["nat"]["ISTIO_REDIRECT"] == ["-p tcp -j REDIRECT --to-ports 15001"]
    assert "-p tcp -j ISTIO_INBOUND" in after["nat"]["PREROUTING"]
    assert istio_portion(after) == expected(backend, ISTIO_INIT)
    assert "-A ISTIO_OUTPUT" in first.saved["v4"]

    again = apply_capture(ISTIO_INIT, netns=pod.path, backend=backend)
    assert (again.action, again.changed, len(restores)) == ("unchanged", False, 1)
    assert state(backend, pod) == after


def test_a_different_config_replaces_the_old_rules_without_leftovers(backend: Backend, pod: Netns) -> None:
    pod.exec(backend.binary("v4"), "-t", "nat", "-A", "OUTPUT", "-p", "udp", "--dport", "9", "-j", "ACCEPT")
    apply_capture(RICH, netns=pod.path, backend=backend)
    assert "ISTIO_TPROXY" in istio_chains(state(backend, pod))

    replaced = apply_capture(ISTIO_INIT, netns=pod.path, backend=backend)
    assert replaced.action == "replaced"
    after = state(backend, pod)
    assert istio_portion(after, expected(backend, ISTIO_INIT)) == expected(backend, ISTIO_INIT)
    assert not istio_chains({t: c for t, c in after.items() if t != "nat"})  # TPROXY, DNS, drop-invalid
    assert "raw" not in after
    # What RICH wrote into built-in chains without a jump is not ISTIO_INIT's, so it stays (as in
    # Istio: cleaning up with RICH's flags removes it); none of it can capture anything any more.
    leftover = {c: r for c, r in after.get("mangle", {}).items()}
    assert all(not rule.split()[-1].startswith("ISTIO_") for rules in leftover.values() for rule in rules)
    assert "-p udp -m udp --dport 9 -j ACCEPT" in after["nat"]["OUTPUT"]  # not Istio's: kept
    assert "lookup 133" not in pod.ip("rule", "show")


def test_cleanup_only_removes_every_istio_rule(backend: Backend, pod: Netns) -> None:
    apply_capture(RICH, netns=pod.path, backend=backend)
    cleaned = apply_capture(RICH, netns=pod.path, backend=backend, cleanup_only=True)
    assert cleaned.action == "cleaned"
    assert state(backend, pod) == {}
    assert "lookup 133" not in pod.ip("rule", "show")
    assert apply_capture(RICH, netns=pod.path, backend=backend, cleanup_only=True).action == "clean"


def _with_bad_rule(monkeypatch: pytest.MonkeyPatch, rule: Rule, *, v6: bool = False) -> None:
    """The config's rules plus one iptables refuses, appended to the last table (or the v6 set)."""

    def build_with_bad_rule(config: CaptureConfig) -> RuleSet:
        rules = build(config)
        (rules.v6 if v6 else rules.v4).append(rule)
        return rules

    monkeypatch.setattr(apply_module, "build", build_with_bad_rule)


BAD = Rule("raw", "OUTPUT", ("-m", "no_such_match", "-j", "RETURN"))


def test_a_restore_failing_halfway_leaves_the_namespace_as_it_was(
    backend: Backend, pod: Netns, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nat is written, then raw fails: its chain BLOCKER exists in the pod (not in an empty namespace,
    so the config itself is fine) and ``-N BLOCKER`` is refused. Everything comes back as it was."""
    apply_capture(ISTIO_INIT, netns=pod.path, backend=backend)
    pod.exec(backend.binary("v4"), "-t", "raw", "-N", "BLOCKER")
    before = state(backend, pod)
    _with_bad_rule(monkeypatch, Rule("raw", "OUTPUT", ("-j", "BLOCKER")))
    dns = dataclasses.replace(ISTIO_INIT, redirect_dns=True, capture_all_dns=True)  # nat and raw change
    with pytest.raises(ApplyError) as failed:
        apply_capture(dns, netns=pod.path, backend=backend)
    message = str(failed.value)
    assert message.startswith(f"{backend.binary('v4', 'restore')} --noflush")
    assert "the rules before were restored" in message
    assert state(backend, pod) == before


def test_a_config_iptables_refuses_is_caught_before_anything_is_written(
    backend: Backend, pod: Netns, monkeypatch: pytest.MonkeyPatch
) -> None:
    apply_capture(ISTIO_INIT, netns=pod.path, backend=backend)
    before = state(backend, pod)
    _with_bad_rule(monkeypatch, BAD)
    with pytest.raises(ApplyError, match=r"refuses the rules .*nothing was changed.*no_such_match"):
        apply_capture(dataclasses.replace(ISTIO_INIT, redirect_dns=True), netns=pod.path, backend=backend)
    assert state(backend, pod) == before


def test_a_failing_first_apply_leaves_no_rule_behind(
    backend: Backend, pod: Netns, monkeypatch: pytest.MonkeyPatch
) -> None:
    _with_bad_rule(monkeypatch, BAD)
    with pytest.raises(ApplyError):
        dns = dataclasses.replace(ISTIO_INIT, redirect_dns=True, capture_all_dns=True)
        apply_capture(dns, netns=pod.path, backend=backend)
    assert state(backend, pod) == {}


def test_a_failing_ipv6_restore_rolls_back_ipv4_too(
    backend: Backend, pod: Netns, monkeypatch: pytest.MonkeyPatch
) -> None:
    _with_bad_rule(monkeypatch, Rule("nat", "OUTPUT", ("-m", "no_such_match", "-j", "RETURN")), v6=True)
    with pytest.raises(ApplyError, match=backend.binary("v6", "restore")):
        apply_capture(dataclasses.replace(ISTIO_INIT, enable_ipv6=True), netns=pod.path, backend=backend)
    assert state(backend, pod, "v4") == {}
    assert state(backend, pod, "v6") == {}


def test_ipv6_rules_only_when_enabled(backend: Backend, pod: Netns) -> None:
    apply_capture(ISTIO_INIT, netns=pod.path, backend=backend)
    assert state(backend, pod, "v6") == {}
    both = dataclasses.replace(ISTIO_INIT, enable_ipv6=True)
    assert apply_capture(both, netns=pod.path, backend=backend).action == "replaced"
    assert "-s ::6/128 -o lo -j RETURN" in state(backend, pod, "v6")["nat"]["ISTIO_OUTPUT"]
    assert "::6/128" in pod.ip("-6", "address", "show", "dev", "lo")
    assert apply_capture(ISTIO_INIT, netns=pod.path, backend=backend).action == "replaced"
    assert state(backend, pod, "v6") == {}  # IPv6 turned off: its rules do not linger


def test_tproxy_routes_are_added_once(backend: Backend, pod: Netns) -> None:
    config = dataclasses.replace(RICH, enable_ipv6=True)
    apply_capture(config, netns=pod.path, backend=backend)
    again = apply_capture(config, netns=pod.path, backend=backend)
    assert again.action == "unchanged"
    for family in ([], ["-6"]):
        rules = pod.ip(*family, "rule", "show")
        assert rules.count("fwmark 0x539 lookup 133") == 1, rules
        assert "local default dev lo" in pod.ip(*family, "route", "show", "table", "133")


def test_a_vanished_namespace_is_a_clear_error(backend: Backend) -> None:
    with pytest.raises(ApplyError, match="network namespace /run/netns/ia-gone does not exist"):
        apply_capture(ISTIO_INIT, netns=Path("/run/netns/ia-gone"), backend=backend)


def test_a_spent_deadline_stops_before_any_command(backend: Backend, pod: Netns) -> None:
    with pytest.raises(ApplyError, match="the time budget is spent"):
        apply_capture(ISTIO_INIT, netns=pod.path, backend=backend, deadline=Deadline.after(0).at)
    assert state(backend, pod) == {}


def test_writes_in_a_pod_never_take_the_nodes_xtables_lock(
    backend: Backend, pod: Netns, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held lock on the node's default lock file: a pod write must not wait for it (istio PR #47002)."""
    import fcntl

    lock = Path("/run/xtables.lock")
    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        apply_capture(ISTIO_INIT, netns=pod.path, backend=backend, deadline=Deadline.after(5).at)
    assert istio_chains(state(backend, pod))


FOREIGN = [  # rules of other software in built-in chains, several of the shapes Istio writes there
    ("nat", "PREROUTING", "-i", "wg0", "-j", "RETURN"),
    ("nat", "OUTPUT", "-o", "wg0", "-j", "RETURN"),
    ("nat", "PREROUTING", "-i", "eth9", "-j", "RETURN"),  # a copy of a rule RICH writes too
    ("mangle", "PREROUTING", "-p", "udp", "-j", "CONNMARK", "--restore-mark"),  # wg-quick
    ("mangle", "POSTROUTING", "-p", "udp", "-m", "mark", "--mark", "0xca6c", "-j", "CONNMARK", "--save-mark"),
    ("mangle", "OUTPUT", "-p", "tcp", "-j", "MARK", "--set-mark", "7"),
    ("mangle", "OUTPUT", "-p", "tcp", "-m", "mark", "--mark", "0x7", "-j", "RETURN"),
    ("filter", "INPUT", "-i", "wg0", "-j", "RETURN"),
    ("filter", "FORWARD", "-o", "wg0", "-j", "RETURN"),
]


def test_rules_of_other_software_survive_apply_replace_and_cleanup(backend: Backend, pod: Netns) -> None:
    """Issue 20: rules were matched by shape, so a VPN's CONNMARK or interface RETURN rules went too."""
    for table, chain, *params in FOREIGN:
        pod.exec(backend.binary("v4"), "-t", table, "-A", chain, *params)
    baseline = state(backend, pod)

    def foreign_rules_intact() -> bool:
        now = state(backend, pod)
        return all(
            Counter(now.get(table, {}).get(chain, [])) >= Counter(rules)
            for table, chains in baseline.items()
            for chain, rules in chains.items()
        )

    apply_capture(RICH, netns=pod.path, backend=backend)
    assert foreign_rules_intact()
    assert apply_capture(ISTIO_INIT, netns=pod.path, backend=backend).action == "replaced"
    assert foreign_rules_intact()
    assert apply_capture(RICH, netns=pod.path, backend=backend).action == "replaced"
    assert apply_capture(RICH, netns=pod.path, backend=backend).action == "unchanged"
    assert apply_capture(RICH, netns=pod.path, backend=backend, cleanup_only=True).action == "cleaned"
    assert state(backend, pod) == baseline  # exactly Istio's rules went, one copy of eth9's RETURN stays


def concurrently(apply: Callable[[], str], runs: int = 6) -> list[str]:
    """``apply`` started ``runs`` times at once (a barrier); each one's action, or its ApplyError."""
    start = threading.Barrier(runs)
    results: list[str] = []

    def one() -> None:
        start.wait()
        try:
            results.append(apply())
        except ApplyError as err:
            results.append(f"failed: {err}")

    threads = [threading.Thread(target=one) for _ in range(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return sorted(results)


def test_concurrent_applies_on_one_namespace_take_turns(backend: Backend, pod: Netns) -> None:
    """Issue 20: six identical applies at once: some failed and their rollback wiped the others' rules."""
    for _ in range(3):
        results = concurrently(lambda: apply_capture(ISTIO_INIT, netns=pod.path, backend=backend).action)
        assert results == ["applied"] + ["unchanged"] * 5, results
        assert istio_portion(state(backend, pod)) == expected(backend, ISTIO_INIT)
        apply_capture(ISTIO_INIT, netns=pod.path, backend=backend, cleanup_only=True)


def test_ipv6_follows_the_namespace_addresses() -> None:
    with pod_and_peer() as (pod, _), pod_and_peer(ipv6=True) as (pod6, _):
        assert not ipv6_enabled(addresses(pod.path), dual_stack=True)
        # 10.77.0.2 comes first: single-stack decides IPv4, dual-stack sees the v6 address too
        assert not ipv6_enabled(addresses(pod6.path), dual_stack=False)
        assert ipv6_enabled(addresses(pod6.path), dual_stack=True)


def test_a_foreign_rule_in_a_builtin_chain_is_no_reason_to_rewrite(
    backend: Backend, pod: Netns, restores: list[str]
) -> None:
    apply_capture(ISTIO_INIT, netns=pod.path, backend=backend)
    pod.exec(backend.binary("v4"), "-t", "nat", "-A", "OUTPUT", "-p", "udp", "--dport", "9", "-j", "ACCEPT")
    assert apply_capture(ISTIO_INIT, netns=pod.path, backend=backend).action == "unchanged"
    assert len(restores) == 1


def test_an_extra_rule_in_an_istio_chain_is_replaced_away(backend: Backend, pod: Netns) -> None:
    """Istio reports a delta here and fails without --reconcile; the re-run repairs it instead."""
    apply_capture(ISTIO_INIT, netns=pod.path, backend=backend)
    extra = ["-t", "nat", "-A", "ISTIO_INBOUND", "-p", "tcp", "--dport", "7777", "-j", "RETURN"]
    pod.exec(backend.binary("v4"), *extra)
    assert apply_capture(ISTIO_INIT, netns=pod.path, backend=backend).action == "replaced"
    assert istio_portion(state(backend, pod)) == expected(backend, ISTIO_INIT)


def test_mixed_families_foreign_v6_rule_stays_and_stale_v6_istio_rules_go(
    backend: Backend, pod: Netns
) -> None:
    ip6 = backend.binary("v6")
    pod.exec(ip6, "-t", "nat", "-A", "OUTPUT", "-p", "udp", "--dport", "9", "-j", "ACCEPT")
    assert apply_capture(ISTIO_INIT, netns=pod.path, backend=backend).action == "applied"
    assert state(backend, pod, "v6") == {"nat": {"OUTPUT": ["-p udp -m udp --dport 9 -j ACCEPT"]}}

    pod.exec(ip6, "-t", "nat", "-N", "ISTIO_INBOUND")
    pod.exec(ip6, "-t", "nat", "-A", "ISTIO_INBOUND", "-p", "tcp", "--dport", "15008", "-j", "RETURN")
    assert apply_capture(ISTIO_INIT, netns=pod.path, backend=backend).action == "replaced"
    assert state(backend, pod, "v6") == {"nat": {"OUTPUT": ["-p udp -m udp --dport 9 -j ACCEPT"]}}
    assert istio_portion(state(backend, pod)) == expected(backend, ISTIO_INIT)


@dataclasses.dataclass(frozen=True)
class _NoIp6tables(Backend):
    """The backend of a node without ip6tables."""

    def binary(self, family: str, tool: str = "") -> str:
        return "ip6tables-missing" if family == "v6" else super().binary(family, tool)


def test_a_missing_ip6tables_is_fatal_only_with_ipv6_on(backend: Backend, pod: Netns) -> None:
    no_v6 = _NoIp6tables(backend.flavor, backend.version)
    assert apply_capture(ISTIO_INIT, netns=pod.path, backend=no_v6).action == "applied"
    with pytest.raises(ApplyError, match=r"ip6tables-missing .*No such file or directory"):
        apply_capture(dataclasses.replace(ISTIO_INIT, enable_ipv6=True), netns=pod.path, backend=no_v6)


def _detected_in(space: Netns, **env: str) -> str:
    code = "import os; from istio_agent.cni.iptables import detect; print(detect(os.environ).flavor)"
    return space.exec("env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-c", code).strip()


def test_the_backend_is_the_one_holding_the_nodes_rules(pod: Netns) -> None:
    """Detection runs in the namespace it is called from (the node's, for the plugin)."""
    assert _detected_in(pod) == "nft"  # no legacy rules: the default
    pod.exec("iptables-legacy", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "--dport", "9", "-j", "ACCEPT")
    assert _detected_in(pod) == "legacy"
    assert _detected_in(pod, FORCE_IPTABLES_BINARY="nft") == "nft"


def test_cleanup_in_a_vanished_namespace_is_an_error_not_clean(backend: Backend) -> None:
    with pytest.raises(ApplyError, match="does not exist"):
        apply_capture(ISTIO_INIT, netns=Path("/run/netns/ia-gone"), backend=backend, cleanup_only=True)


def test_applying_needs_no_host_tool_but_iptables(
    backend: Backend, pod: Netns, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node offers its iptables binaries and nothing else the plugin may lean on (no nsenter, ip,
    unshare or sh): the namespace is entered, tried out and routed in-process."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for binary in Path("/usr/sbin").glob("ip*tables*"):
        (tools / binary.name).symlink_to(binary)
    config = dataclasses.replace(RICH, enable_ipv6=True)
    with monkeypatch.context() as only_iptables:
        only_iptables.setenv("PATH", str(tools))
        assert apply_capture(config, netns=pod.path, backend=backend).action == "applied"
        assert apply_capture(config, netns=pod.path, backend=backend).action == "unchanged"
        assert addresses(pod.path)[:1] == ["127.0.0.1"]
    assert istio_portion(state(backend, pod, "v6"), expected(backend, config, "v6")) == expected(
        backend, config, "v6"
    )
    for family in ([], ["-6"]):
        assert "fwmark 0x539 lookup 133" in pod.ip(*family, "rule", "show")
        assert "local default dev lo" in pod.ip(*family, "route", "show", "table", "133")
    assert "::6/128" in pod.ip("-6", "address", "show", "dev", "lo")
    with monkeypatch.context() as only_iptables:
        only_iptables.setenv("PATH", str(tools))
        assert apply_capture(config, netns=pod.path, backend=backend, cleanup_only=True).action == "cleaned"
    assert "lookup 133" not in pod.ip("rule", "show") + pod.ip("-6", "rule", "show")
