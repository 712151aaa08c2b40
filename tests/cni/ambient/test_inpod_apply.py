"""Applying ambient's in-pod redirection for real, in fresh network namespaces.

Three backends: iptables-legacy, iptables-nft and native nftables. Every case of Istio's goldens is
applied with ``apply_inpod`` and read back (``iptables-save`` per family, ``nft -s list ruleset``),
and compared with what Istio's own golden installs in an empty namespace (its restore input per
family, or its ``nft -f`` transaction), so both sides are in the tools' own listing form. Then what
Istio's tests cannot show with their stubs: a re-run changes nothing, a different set is replaced
(or refused without reconcile), the policy routing, and ``remove_inpod`` leaving nothing of ours.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from istio_agent.cni.ambient.inpod import ApplyError, InpodSettings, PodRedirect, apply_inpod, remove_inpod
from istio_agent.cni.iptables import Backend, Tables, parse_save, probe
from istio_agent.cni.netns import CommandError
from istio_agent.cni.rules import BUILTIN
from tests.cni.ambient.test_inpod_rules import IN_POD, golden, settings
from tests.cni.netns import Netns, needs_root, netns

pytestmark = [
    needs_root,
    pytest.mark.skipif(shutil.which("nft") is None, reason="nft is not installed (Debian nftables)"),
]
NATIVE = "nftables"
FLAVORS = ("legacy", "nft", NATIVE)
"""iptables-legacy, iptables-nft, and native nftables."""


@pytest.fixture(params=FLAVORS)
def flavor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pod() -> Iterator[Netns]:
    with netns() as space:
        yield space


def with_backend(config: InpodSettings, flavor: str) -> InpodSettings:
    """The settings for one backend (the iptables one probed here, as the node agent detects it)."""
    if flavor == NATIVE:
        return dataclasses.replace(config, native_nftables=True)
    try:
        return dataclasses.replace(config, iptables_backend=probe(flavor))
    except CommandError as err:
        pytest.skip(f"iptables-{flavor} is not usable here: {err}")


def iptables_state(backend: Backend, space: Netns, family: str) -> Tables:
    """The namespace's rules, empty built-in chains and tables left out (legacy shows no table until
    used, nft keeps an emptied one: both mean "no rules")."""
    out: Tables = {}
    for table, chains in parse_save(backend.save(family, netns=space.path)).items():
        kept = {chain: rules for chain, rules in chains.items() if rules or chain not in BUILTIN}
        if kept:
            out[table] = kept
    return out


def state(config: InpodSettings, space: Netns) -> object:
    """Everything of the namespace's rules, in the backend's own listing form."""
    if config.native_nftables:
        return space.exec("nft", "-s", "list", "ruleset")
    backend = config.iptables_backend
    assert backend is not None
    families = ("v4", "v6") if config.ipv6 else ("v4",)
    return {family: iptables_state(backend, space, family) for family in families}


def golden_restores(text: str) -> dict[str, str]:
    """An iptables golden's restore input per family: after the two saves, v4's tables (in name
    order), then v6's, which start again from the first table name."""
    families: dict[str, list[str]] = {"v4": [], "v6": []}
    family, last = "v4", ""
    for line in text.splitlines()[2:]:
        if line.startswith("* "):
            if line <= last:
                family = "v6"
            last = line
        families[family].append(line)
    return {name: "".join(f"{line}\n" for line in lines) for name, lines in families.items() if lines}


def installed_by_golden(config: InpodSettings, name: str) -> object:
    """What Istio's golden for ``name`` installs in an empty namespace, read back as :func:`state`."""
    with netns("istio") as space:
        if config.native_nftables:
            space.exec("nft", "-f", "-", input=golden("nftables", name, config.ipv6))
        else:
            backend = config.iptables_backend
            assert backend is not None
            for family, text in golden_restores(golden("iptables", name, config.ipv6)).items():
                backend.restore(family, text, netns=space.path)
        return state(config, space)


@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
@pytest.mark.parametrize("name", sorted(IN_POD))
def test_applied_rules_are_what_istios_golden_installs(
    flavor: str, name: str, ipv6: bool, pod: Netns
) -> None:
    config, overrides = settings(name, ipv6)
    config = with_backend(config, flavor)
    assert apply_inpod(pod.path, config, overrides) == "applied"
    assert state(config, pod) == installed_by_golden(config, name)


def test_a_rerun_changes_nothing(flavor: str, pod: Netns) -> None:
    config, overrides = settings("default", True)
    config = with_backend(config, flavor)
    apply_inpod(pod.path, config, overrides)
    before = state(config, pod)
    assert apply_inpod(pod.path, config, overrides) == "unchanged"
    assert state(config, pod) == before


def test_a_different_set_is_replaced_without_leftovers(flavor: str, pod: Netns) -> None:
    """reconcile (the default): a pod holding the rules of other overrides gets exactly the new ones."""
    config, _ = settings("default", False)
    config = with_backend(config, flavor)
    apply_inpod(pod.path, config, PodRedirect(virtual_interfaces=("fake1s0f0",)))
    ingress_config, ingress = settings("ingress", False)
    ingress_config = dataclasses.replace(ingress_config, native_nftables=config.native_nftables)
    ingress_config = dataclasses.replace(ingress_config, iptables_backend=config.iptables_backend)
    assert apply_inpod(pod.path, ingress_config, ingress) == "replaced"
    assert state(ingress_config, pod) == installed_by_golden(ingress_config, "ingress")


def test_without_reconcile_other_istio_rules_are_an_error_and_stay(pod: Netns) -> None:
    config, _ = settings("default", False)
    config = dataclasses.replace(with_backend(config, "nft"), reconcile=False)
    apply_inpod(pod.path, config, PodRedirect())
    before = state(config, pod)
    assert apply_inpod(pod.path, config, PodRedirect()) == "unchanged"
    with pytest.raises(ApplyError, match="reconciling is off"):
        apply_inpod(pod.path, config, PodRedirect(ingress_mode=True))
    assert state(config, pod) == before


def ip_rules(space: Netns, family: str) -> list[str]:
    return [line for line in space.ip(f"-{family[1]}", "rule", "show").splitlines() if "lookup 100" in line]


def table_100(space: Netns, family: str) -> str:
    """The routes of table 100 ("" also when the family has no such table any more)."""
    argv = ["ip", "-n", space.name, f"-{family[1]}", "route", "show", "table", "100"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done.returncode == 0 or "does not exist" in done.stderr, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
def test_the_mark_rule_and_loopback_route_once_each(flavor: str, ipv6: bool, pod: Netns) -> None:
    config, overrides = settings("default", ipv6)
    config = with_backend(config, flavor)
    apply_inpod(pod.path, config, overrides)
    apply_inpod(pod.path, config, overrides)
    assert ip_rules(pod, "v4") == ["32764:\tfrom all fwmark 0x111/0xfff lookup 100"]
    assert table_100(pod, "v4") == "local default dev lo scope host"
    if ipv6:
        assert ip_rules(pod, "v6") == ["32764:\tfrom all fwmark 0x111/0xfff lookup 100"]
        assert table_100(pod, "v6").startswith("local default dev lo ")
    else:
        assert ip_rules(pod, "v6") == []


def test_no_ipv6_loopback_route_when_lo_has_ipv6_off(pod: Netns) -> None:
    pod.exec("sysctl", "-q", "-w", "net.ipv6.conf.lo.disable_ipv6=1")
    config, overrides = settings("default", True)
    apply_inpod(pod.path, with_backend(config, "nft"), overrides)
    assert table_100(pod, "v6") == ""
    assert ip_rules(pod, "v6") == ["32764:\tfrom all fwmark 0x111/0xfff lookup 100"]


@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
def test_remove_leaves_nothing_of_ours_and_may_run_again(flavor: str, ipv6: bool, pod: Netns) -> None:
    config, overrides = settings("default", ipv6)
    config = with_backend(config, flavor)
    empty = state(config, pod)
    apply_inpod(pod.path, config, overrides)
    assert remove_inpod(pod.path, config) == "cleaned"
    assert state(config, pod) == empty
    for family in ("v4", "v6"):
        assert ip_rules(pod, family) == []
        assert table_100(pod, family) == ""
    assert remove_inpod(pod.path, config) == "clean"


def test_remove_keeps_what_is_not_istios(pod: Netns) -> None:
    config = with_backend(InpodSettings(), "nft")
    backend = config.iptables_backend
    assert backend is not None
    backend.restore("v4", "*nat\n:CNI_HOSTPORT -\n-A PREROUTING -j CNI_HOSTPORT\nCOMMIT\n", netns=pod.path)
    pod.exec("nft", "add", "table", "inet", "istio-ambient-natx")
    apply_inpod(pod.path, config, PodRedirect())
    remove_inpod(pod.path, config)
    assert iptables_state(backend, pod, "v4") == {
        "nat": {"PREROUTING": ["-j CNI_HOSTPORT"], "CNI_HOSTPORT": []}
    }
    native = dataclasses.replace(config, native_nftables=True)
    apply_inpod(pod.path, native, PodRedirect())
    remove_inpod(pod.path, native)
    assert "table inet istio-ambient-natx" in pod.exec("nft", "list", "tables")
    assert "istio-ambient-nat\n" not in pod.exec("nft", "list", "tables")


def test_a_bad_interface_is_refused_and_nothing_is_written(flavor: str, pod: Netns) -> None:
    config = with_backend(InpodSettings(), flavor)
    empty = state(config, pod)
    with pytest.raises(ApplyError, match="interface"):
        apply_inpod(pod.path, config, PodRedirect(virtual_interfaces=("eth0;drop",)))
    assert state(config, pod) == empty


def test_a_vanished_namespace_is_an_apply_error(flavor: str) -> None:
    with netns() as space:
        gone = space.path
    config = with_backend(InpodSettings(), flavor)
    with pytest.raises(ApplyError, match=r"does not exist|not run"):
        apply_inpod(gone, config, PodRedirect())


def test_force_apply_writes_the_rules_anew(flavor: str, pod: Netns) -> None:
    config, overrides = settings("default", False)
    config = with_backend(config, flavor)
    apply_inpod(pod.path, config, overrides)
    forced = dataclasses.replace(config, force_apply=True)
    assert apply_inpod(pod.path, forced, overrides) == "applied"
    assert state(config, pod) == installed_by_golden(config, "default")


def test_sidecar_rules_left_in_the_pod_are_replaced(pod: Netns) -> None:
    """A pod that had istio-init's rules (a sidecar pod turned ambient): Istio's leftovers cleanup."""
    from istio_agent.cni.apply import apply_capture
    from tests.cni.test_apply import ISTIO_INIT

    config, overrides = settings("default", False)
    config = with_backend(config, "nft")
    apply_capture(ISTIO_INIT, netns=pod.path, backend=config.iptables_backend)
    assert apply_inpod(pod.path, config, overrides) == "replaced"
    assert state(config, pod) == installed_by_golden(config, "default")


def test_the_node_agent_detects_the_iptables_flavour_at_its_first_pod_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Istio commits to the node's binaries once; detecting at every pod cost one or two
    ``iptables-*-save`` runs per enrolment. A failed detection is tried again at the next pod."""
    from istio_agent.cni.ambient import inpod
    from istio_agent.cni.ambient.nodeagent import ModuleRules

    calls: list[str] = []
    real_detect = inpod.detect

    def counting_detect(*args: object, **kwargs: object) -> Backend:
        calls.append("detect")
        if len(calls) == 1:
            raise CommandError(["iptables-legacy-save"], "not found (the first try fails)")
        return real_detect(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(inpod, "detect", counting_detect)
    config, pod = settings("default", False)
    rules = ModuleRules(config)
    with netns() as first, netns() as second:
        with pytest.raises(ApplyError, match="not found"):
            rules.apply(first.path, pod)
        rules.apply(first.path, pod)
        rules.apply(second.path, pod)
        rules.remove(first.path)
        backend = rules.settings.iptables_backend
        assert backend is not None and "ISTIO_OUTPUT" in backend.save("v4", netns=second.path)
    assert calls == ["detect", "detect"]
