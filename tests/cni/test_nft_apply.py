"""Applying the nftables rule set for real with ``nft``, in fresh network namespaces.

Every case of Istio's run_test.go is applied, re-run and cleaned up (as Istio's
``run_linux_test.go`` does, owner groups turned into gid 0 so ``skgid`` resolves), and its tables
are compared with what Istio's own golden transaction installs. The rest pins what this applier adds
to Istio's: an identical re-run executes nothing, a change is one transaction, a refused or failing
apply leaves the namespace as it was, and only Istio's three tables are ever touched.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from istio_agent.cni import netns as netns_module
from istio_agent.cni.apply import ApplyError
from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.netns import CommandError, Deadline
from istio_agent.cni.nftables import apply as nft_apply
from istio_agent.cni.nftables.apply import apply_nft_capture, istio_tables
from istio_agent.cni.nftables.builder import MANGLE, NAT, RAW, render_config
from tests.cni.netns import Netns, needs_root, netns, run_peer
from tests.cni.test_apply import ISTIO_INIT as SIDECAR
from tests.cni.test_apply import RICH, concurrently
from tests.cni.test_nft_rules import CASES, GOLDEN, case_config

pytestmark = [
    needs_root,
    pytest.mark.skipif(shutil.which("nft") is None, reason="needs nft (Debian nftables)"),
]
GROUPS = {"java": "0", "202": "0", "888": "0", "ftp": "0"}
"""Istio's group names resolve nowhere here; its run_linux_test.go uses gid 0 instead."""


@pytest.fixture
def pod() -> Iterator[Netns]:
    with netns() as space:
        yield space


def tables(space: Netns) -> dict[str, str]:
    """The namespace's Istio tables, listed without counters."""
    return istio_tables(space.exec("nft", "-s", "list", "ruleset", "inet"))


def ruleset(space: Netns) -> str:
    return space.exec("nft", "-s", "list", "ruleset")


def installed_by(transaction: str) -> dict[str, str]:
    """The Istio tables ``transaction`` leaves in an empty namespace (Istio's own way: ``nft -f``)."""
    with netns("istio") as space:
        space.exec("nft", "-f", "-", input=transaction)
        return tables(space)


def with_numeric_groups(config: CaptureConfig) -> CaptureConfig:
    return dataclasses.replace(
        config,
        owner_groups_include=tuple(GROUPS.get(g, g) for g in config.owner_groups_include),
        owner_groups_exclude=tuple(GROUPS.get(g, g) for g in config.owner_groups_exclude),
    )


def istio_golden(name: str) -> str:
    text = (GOLDEN / f"{name}.golden").read_text()
    for group, gid in GROUPS.items():
        text = text.replace(f"skgid != {group} ", f"skgid != {gid} ").replace(
            f"skgid {group} ", f"skgid {gid} "
        )
    return text


@dataclasses.dataclass
class NftLog:
    """Every nft command run since the fixture started: a logging ``nft`` first on PATH, which
    notes its network namespace and arguments, then runs the real one."""

    path: Path

    def transactions_in(self, space: Netns) -> int:
        """How many ``nft -f`` ran inside ``space``."""
        inode = os.stat(space.path).st_ino
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        return sum(1 for line in lines if line.startswith(f"net:[{inode}] -f"))


@pytest.fixture
def nft_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NftLog:
    log = NftLog(tmp_path / "nft.log")
    stub = tmp_path / "bin" / "nft"
    stub.parent.mkdir()
    stub.write_text(
        f'#!/bin/sh\necho "$(readlink /proc/self/ns/net) $*" >> {log.path}\nexec {shutil.which("nft")} "$@"\n'
    )
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub.parent}:{os.environ['PATH']}")
    return log


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_istio_case_applies_reruns_unchanged_and_cleans_up(name: str, pod: Netns) -> None:
    config = with_numeric_groups(case_config(name))
    assert apply_nft_capture(config, netns=pod.path).action == "applied"
    assert tables(pod) == installed_by(istio_golden(name))
    assert apply_nft_capture(config, netns=pod.path).action == "unchanged"
    assert apply_nft_capture(config, netns=pod.path, cleanup_only=True).action == "cleaned"
    assert ruleset(pod) == ""
    assert apply_nft_capture(config, netns=pod.path, cleanup_only=True).action == "clean"


def test_an_identical_rerun_executes_nothing_and_the_counters_keep_counting(
    pod: Netns, nft_log: NftLog
) -> None:
    first = apply_nft_capture(SIDECAR, netns=pod.path)
    assert (first.action, first.changed, nft_log.transactions_in(pod)) == ("applied", True, 1)
    assert "chain istio-output {" in first.ruleset
    run_peer(pod, 0, "connect", "tcp", "127.0.0.1", "9")  # one SYN through nat output
    counted = pod.exec("nft", "list", "chain", "inet", NAT, "output")
    assert "counter packets 0 " not in counted, counted

    again = apply_nft_capture(SIDECAR, netns=pod.path)
    assert (again.action, again.changed, nft_log.transactions_in(pod)) == ("unchanged", False, 1)
    assert pod.exec("nft", "list", "chain", "inet", NAT, "output") == counted


def test_a_different_config_replaces_istio_tables_in_one_transaction(pod: Netns, nft_log: NftLog) -> None:
    apply_nft_capture(RICH, netns=pod.path)
    assert set(tables(pod)) == {NAT, MANGLE, RAW}
    assert "lookup 133" in pod.ip("rule", "show")

    replaced = apply_nft_capture(SIDECAR, netns=pod.path)
    assert (replaced.action, nft_log.transactions_in(pod)) == ("replaced", 2)
    assert tables(pod) == installed_by(render_config(SIDECAR))  # no mangle, raw or stale chain left
    assert "lookup 133" not in pod.ip("rule", "show")
    assert apply_nft_capture(SIDECAR, netns=pod.path).action == "unchanged"


def test_a_changed_rule_inside_an_istio_table_is_replaced_away(pod: Netns) -> None:
    apply_nft_capture(SIDECAR, netns=pod.path)
    pod.exec("nft", "add", "rule", "inet", NAT, "istio-output", "tcp", "dport", "3306", "return")
    assert apply_nft_capture(SIDECAR, netns=pod.path).action == "replaced"
    assert tables(pod) == installed_by(render_config(SIDECAR))


FOREIGN = """\
table inet filter {
	chain input {
		type filter hook input priority filter; policy accept;
		iifname "wg0" counter return
	}
}
table ip nat {
	chain output {
		type nat hook output priority -100; policy accept;
		oifname "wg0" return
	}
}
table inet istio-proxy-natx {
	chain output {
		type nat hook output priority -100; policy accept;
		oifname "eth9" return
	}
}
"""


def test_other_tables_survive_apply_replace_and_cleanup(pod: Netns) -> None:
    """Only ``inet istio-proxy-{nat,mangle,raw}`` are Istio's: a VPN's tables, a same-shaped rule
    in another table and a table whose name merely starts like Istio's are never touched."""
    pod.exec("nft", "-f", "-", input=FOREIGN)
    baseline = ruleset(pod)
    apply_nft_capture(RICH, netns=pod.path)
    assert apply_nft_capture(SIDECAR, netns=pod.path).action == "replaced"
    assert apply_nft_capture(SIDECAR, netns=pod.path).action == "unchanged"
    assert apply_nft_capture(RICH, netns=pod.path, cleanup_only=True).action == "cleaned"
    assert ruleset(pod) == baseline


def test_a_config_nft_refuses_changes_nothing(pod: Netns) -> None:
    """Tried in an empty namespace first: an owner group that does not exist never reaches the pod."""
    apply_nft_capture(SIDECAR, netns=pod.path)
    before = ruleset(pod)
    refused = dataclasses.replace(SIDECAR, owner_groups_include=("no-such-group-here",))
    with pytest.raises(
        ApplyError, match=r"nft refuses the rules .*nothing was changed.*Group does not exist"
    ):
        apply_nft_capture(refused, netns=pod.path)
    assert ruleset(pod) == before


def test_a_failing_first_apply_leaves_no_table(pod: Netns) -> None:
    refused = dataclasses.replace(SIDECAR, owner_groups_exclude=("no-such-group-here",))
    with pytest.raises(ApplyError, match=r"nft -f - failed .*Group does not exist"):
        apply_nft_capture(refused, netns=pod.path)
    assert ruleset(pod) == ""


def test_a_failing_tproxy_route_puts_the_old_tables_back(pod: Netns, monkeypatch: pytest.MonkeyPatch) -> None:
    apply_nft_capture(SIDECAR, netns=pod.path)
    before = tables(pod)

    def no_route(*args: object, **kwargs: object) -> None:
        raise CommandError(["ip", "rule", "add"], "failed (netlink)", "Operation not permitted")

    monkeypatch.setattr(nft_apply.tproxy_routes, "ensure", no_route)
    with pytest.raises(ApplyError, match="Operation not permitted; the nftables rules before were put back"):
        apply_nft_capture(RICH, netns=pod.path)
    assert tables(pod) == before


def test_tproxy_routes_are_added_once_and_removed_with_the_tables(pod: Netns) -> None:
    config = dataclasses.replace(RICH, enable_ipv6=True)
    apply_nft_capture(config, netns=pod.path)
    assert apply_nft_capture(config, netns=pod.path).action == "unchanged"
    for family in ([], ["-6"]):
        assert pod.ip(*family, "rule", "show").count("fwmark 0x539 lookup 133") == 1
        assert "local default dev lo" in pod.ip(*family, "route", "show", "table", "133")
    assert "::6/128" in pod.ip("-6", "address", "show", "dev", "lo")
    assert apply_nft_capture(config, netns=pod.path, cleanup_only=True).action == "cleaned"
    assert "lookup 133" not in pod.ip("rule", "show") + pod.ip("-6", "rule", "show")


def test_a_missing_nft_is_istios_error(pod: Netns, tmp_path: Path) -> None:
    with pytest.raises(ApplyError, match="nativeNftables is enabled, but the nft binary is missing"):
        apply_nft_capture(SIDECAR, netns=pod.path, env={"PATH": str(tmp_path)})


def test_a_vanished_namespace_is_a_clear_error() -> None:
    with pytest.raises(ApplyError, match="network namespace /run/netns/ia-gone does not exist"):
        apply_nft_capture(SIDECAR, netns=Path("/run/netns/ia-gone"))


def test_a_spent_deadline_stops_before_any_command(pod: Netns) -> None:
    with pytest.raises(ApplyError, match="the time budget is spent"):
        apply_nft_capture(SIDECAR, netns=pod.path, deadline=Deadline.after(0).at)
    assert ruleset(pod) == ""


def test_a_bad_config_is_an_apply_error(pod: Netns) -> None:
    with pytest.raises(ApplyError, match="invalid interface name 'eth0;'"):
        apply_nft_capture(dataclasses.replace(SIDECAR, exclude_interfaces=("eth0;",)), netns=pod.path)


def test_concurrent_applies_on_one_namespace_take_turns(pod: Netns) -> None:
    results = concurrently(lambda: apply_nft_capture(SIDECAR, netns=pod.path).action)
    assert results == ["applied"] + ["unchanged"] * 5, results


def test_applying_needs_no_host_tool_but_nft(
    pod: Netns, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ip, nsenter, unshare or sh: the namespace is entered, tried out and routed in-process."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nft").symlink_to(shutil.which("nft") or "nft")
    config = dataclasses.replace(RICH, enable_ipv6=True)
    with monkeypatch.context() as only_nft:
        only_nft.setenv("PATH", str(tools))
        assert apply_nft_capture(config, netns=pod.path).action == "applied"
        assert apply_nft_capture(SIDECAR, netns=pod.path).action == "replaced"
        assert apply_nft_capture(SIDECAR, netns=pod.path, cleanup_only=True).action == "cleaned"
    assert ruleset(pod) == ""
    assert netns_module.addresses(pod.path)[:1] == ["127.0.0.1"]


def test_only_ipv6_dns_servers_in_an_ipv4_pod_apply(pod: Netns) -> None:
    config = dataclasses.replace(SIDECAR, redirect_dns=True, dns_servers=("fd00::10",))
    assert apply_nft_capture(config, netns=pod.path).action == "applied"
    assert RAW not in tables(pod)
