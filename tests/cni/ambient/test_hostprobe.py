"""The host side of ambient's probes for real: a namespace stands for the node, never the real one.

A "host" and a "pod" namespace joined by a veth (``tests/cni/netns.pod_and_peer``: the peer is the
host). ``HostProbeRules`` installs the SNAT rules and the probe set in the host namespace (iptables
with an ipset, legacy and nft; or native nftables), and a connection the host makes to the pod's IP
arrives at a listener in the pod from 169.254.7.127 once the pod's IP is in the set, from the host's
own address otherwise. Native nftables matches kubelet's uid: the probing socket is made with that
fsuid (``setfsuid(2)`` on the thread that makes it), another uid is not SNATed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from istio_agent.cni.ambient.hostprobe import HostProbeRules, kubelet_uid
from istio_agent.cni.ambient.settings import SNAT_V4, SNAT_V6, InpodSettings
from istio_agent.cni.apply import ApplyError
from istio_agent.cni.iptables import probe
from istio_agent.cni.netns import CommandError
from tests.cni.ambient.test_inpod_apply import NATIVE, golden_restores, iptables_state
from tests.cni.ambient.test_inpod_rules import golden
from tests.cni.netns import PEER_IP, POD_IP, Netns, enter, needs_root, netns, pod_and_peer

pytestmark = [
    needs_root,
    pytest.mark.skipif(shutil.which("ipset") is None, reason="ipset is not installed (Debian ipset)"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nft is not installed (Debian nftables)"),
]
KUBELET = 4242
"""The uid kubelet runs as in these tests."""
POD_V6, HOST_V6 = "fd77::2", "fd77::1"
_libc = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(params=["legacy", "nft", NATIVE])
def flavor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def host_settings(flavor: str, *, ipv6: bool = False) -> InpodSettings:
    config = InpodSettings(ipv6=ipv6)
    if flavor == NATIVE:
        return dataclasses.replace(config, native_nftables=True)
    try:
        return dataclasses.replace(config, iptables_backend=probe(flavor))
    except CommandError as err:
        pytest.skip(f"iptables-{flavor} is not usable here: {err}")


@pytest.fixture
def pair() -> Iterator[tuple[Netns, Netns]]:
    """(pod, host), with IPv6 and a v6 default route in the pod (replies to the v6 SNAT address)."""
    with pod_and_peer(ipv6=True) as (pod, host):
        pod.ip("-6", "route", "add", "default", "via", HOST_V6)
        # Neighbours known up front: an SNATed first packet to an unresolved v6 neighbour is lost
        # in this two-namespace setup (the pod answers the solicitation towards the SNAT address).
        for space, other, addresses in ((host, pod, (POD_IP, POD_V6)), (pod, host, (PEER_IP, HOST_V6))):
            mac = other.exec("cat", "/sys/class/net/eth0/address").strip()
            for address in addresses:
                space.ip("neigh", "replace", address, "lladdr", mac, "dev", "eth0", "nud", "permanent")
        yield pod, host


def rules_for(config: InpodSettings, host: Netns) -> HostProbeRules:
    return HostProbeRules(config, netns=host.path, kubelet_uid=str(KUBELET))


def probe_source(pod: Netns, host: Netns, *, v6: bool = False, uid: int = KUBELET) -> str:
    """Connect from the host (a socket of ``uid``) to the pod's IP; the source the pod's listener sees."""
    family = socket.AF_INET6 if v6 else socket.AF_INET
    target = POD_V6 if v6 else POD_IP
    with pod.socket(family) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((target, 8080))
        listener.listen(1)
        listener.settimeout(3)
        with socket_as(host.path, family, uid) as client:
            client.settimeout(3)
            client.connect((target, 8080))
            conn, peer = listener.accept()
            conn.close()
    return str(peer[0])


def socket_as(path: Path, family: socket.AddressFamily, uid: int) -> socket.socket:
    """A TCP socket in the namespace at ``path`` owned by ``uid`` (its fsuid when made), as kubelet's."""
    made: list[socket.socket | OSError] = []

    def make() -> None:
        try:
            enter(path)
            _libc.setfsuid(uid)
            made.append(socket.socket(family, socket.SOCK_STREAM))
        except OSError as err:
            made.append(err)

    thread = threading.Thread(target=make)  # the thread's fsuid and namespace die with it
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


def test_install_writes_istios_host_rules_and_the_sets(flavor: str, pair: tuple[Netns, Netns]) -> None:
    _, host = pair
    config = host_settings(flavor, ipv6=True)
    rules_for(config, host).install()
    if config.native_nftables:
        with netns("istio") as space:
            space.exec("nft", "-f", "-", input=_sets_then(golden("nftables", "hostprobe", True)))
            want = space.exec("nft", "-s", "list", "ruleset")
        # the golden has constructTestConfig's made-up v6 address and kubelet uid 1000
        want = want.replace("e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164", SNAT_V6).replace("1000", str(KUBELET))
        assert host.exec("nft", "-s", "list", "ruleset") == want
        return
    backend = config.iptables_backend
    assert backend is not None
    with netns("istio") as space:
        for name, family in (("istio-inpod-probes-v4", "inet"), ("istio-inpod-probes-v6", "inet6")):
            space.exec("ipset", "create", name, "hash:ip", "family", family, "comment")
        for family, text in golden_restores(golden("iptables", "hostprobe", True)).items():
            backend.restore(family, text, netns=space.path)
        want = {family: iptables_state(backend, space, family) for family in ("v4", "v6")}
    assert {family: iptables_state(backend, host, family) for family in ("v4", "v6")} == want
    assert host.exec("ipset", "list", "-n").split() == ["istio-inpod-probes-v4", "istio-inpod-probes-v6"]


def _sets_then(transaction: str) -> str:
    from istio_agent.cni.ambient.hostprobe_rules import nft_sets

    return nft_sets(InpodSettings(ipv6=True)) + transaction


def test_install_twice_keeps_the_entries(flavor: str, pair: tuple[Netns, Netns]) -> None:
    _, host = pair
    rules = rules_for(host_settings(flavor), host)
    rules.install()
    rules.add_pod_ips([POD_IP], uid="uid-1")
    before = iptables_or_nft(rules, host)
    rules.install()
    assert rules.pod_ips() == {POD_IP: "uid-1"}
    assert iptables_or_nft(rules, host) == before


def iptables_or_nft(rules: HostProbeRules, host: Netns) -> object:
    if rules.settings.native_nftables:
        return host.exec("nft", "-s", "list", "ruleset")
    backend = rules.settings.iptables_backend
    assert backend is not None
    return iptables_state(backend, host, "v4")


def test_a_probe_to_an_enrolled_pod_leaves_the_host_from_the_snat_address(
    flavor: str, pair: tuple[Netns, Netns]
) -> None:
    pod, host = pair
    rules = rules_for(host_settings(flavor), host)
    rules.install()
    assert probe_source(pod, host) == PEER_IP  # not enrolled yet
    rules.add_pod_ips([POD_IP], uid="uid-1")
    assert probe_source(pod, host) == SNAT_V4
    rules.remove_pod_ips([POD_IP])
    assert probe_source(pod, host) == PEER_IP


def test_ipv6_probes_leave_from_the_v6_snat_address(flavor: str, pair: tuple[Netns, Netns]) -> None:
    pod, host = pair
    rules = rules_for(host_settings(flavor, ipv6=True), host)
    rules.install()
    rules.add_pod_ips([POD_IP, POD_V6], uid="uid-1")
    assert rules.pod_ips() == {POD_IP: "uid-1", POD_V6: "uid-1"}
    assert probe_source(pod, host, v6=True) == SNAT_V6
    assert probe_source(pod, host) == SNAT_V4


def test_without_ipv6_a_v6_ip_is_skipped(flavor: str, pair: tuple[Netns, Netns]) -> None:
    _, host = pair
    rules = rules_for(host_settings(flavor), host)
    rules.install()
    rules.add_pod_ips([POD_V6, f"::ffff:{POD_IP}"], uid="u")
    assert rules.pod_ips() == {POD_IP: "u"}


def test_native_nftables_snats_only_kubelets_sockets(pair: tuple[Netns, Netns]) -> None:
    pod, host = pair
    rules = rules_for(host_settings(NATIVE), host)
    rules.install()
    rules.add_pod_ips([POD_IP], uid="uid-1")
    assert probe_source(pod, host, uid=KUBELET) == SNAT_V4
    assert probe_source(pod, host, uid=KUBELET + 1) == PEER_IP


def test_removing_with_a_uid_spares_another_pods_entry(flavor: str, pair: tuple[Netns, Netns]) -> None:
    """The IP now belongs to a new pod: the old pod's removal leaves it (Istio's comment check)."""
    _, host = pair
    rules = rules_for(host_settings(flavor), host)
    rules.install()
    rules.add_pod_ips([POD_IP], uid="new-pod")
    rules.remove_pod_ips([POD_IP], uid="old-pod")
    assert rules.pod_ips() == {POD_IP: "new-pod"}
    rules.remove_pod_ips([POD_IP], uid="new-pod")
    assert rules.pod_ips() == {}
    rules.remove_pod_ips([POD_IP])  # already gone: nothing to do


def test_uninstall_leaves_nothing_and_may_run_again(flavor: str, pair: tuple[Netns, Netns]) -> None:
    _, host = pair
    config = host_settings(flavor, ipv6=True)
    rules = rules_for(config, host)
    rules.install()
    rules.add_pod_ips([POD_IP, POD_V6], uid="u")
    rules.uninstall()
    rules.uninstall()
    assert host.exec("nft", "list", "ruleset").strip() == "" or not config.native_nftables
    assert host.exec("ipset", "list", "-n").strip() == ""
    if config.iptables_backend is not None:
        for family in ("v4", "v6"):
            assert iptables_state(config.iptables_backend, host, family) == {}


def test_native_nftables_without_a_kubelet_is_an_error(pair: tuple[Netns, Netns], tmp_path: Path) -> None:
    _, host = pair
    rules = HostProbeRules(host_settings(NATIVE), netns=host.path, proc=tmp_path)
    with pytest.raises(ApplyError, match="kubelet"):
        rules.install()
    assert host.exec("nft", "list", "ruleset").strip() == ""


def test_kubelet_uid_is_found_in_proc(tmp_path: Path) -> None:
    """A process named kubelet, running as uid 4242, as kubeletuid_linux.go finds it."""
    with tempfile.TemporaryDirectory(dir="/tmp") as where:  # a directory uid 4242 may enter
        Path(where).chmod(0o755)
        binary = Path(where) / "kubelet"
        binary.symlink_to("/bin/sleep")  # comm is the name it was run by
        process = subprocess.Popen([str(binary), "30"], user=KUBELET)
        try:
            assert kubelet_uid(Path("/proc")) == str(KUBELET)
        finally:
            process.kill()
            process.wait()
    with pytest.raises(LookupError, match="kubelet process not found"):
        kubelet_uid(tmp_path)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
