"""Putting a pod in the ambient mesh and taking it out: rules, host probe set, ztunnel, annotation.

Istio's ``cni/pkg/nodeagent/meshdataplane_linux.go`` and ``net_linux.go``. Adding a pod: its network
namespace is opened (the path the plugin's event names, else found by its UID in ``/proc``), the
in-pod rules go in, the pod is handed to ztunnel with that namespace, its IPs go in the host's probe
set, and the pod is annotated ``ambient.istio.io/redirection: enabled``. A failure before ztunnel
(no namespace, rules refused) leaves the pod out and is not retried (:class:`NonRetryableAdd`); when
ztunnel does not take the pod, it stays enrolled (it goes in the next ztunnel's snapshot), is
annotated ``pending`` and the add fails, as Istio's does. Removing reverses the steps; a pod being
deleted keeps its rules (they go with its namespace) and may have lost its annotation already.

The namespace of every enrolled pod is held open (an fd, as Istio holds it) for as long as the pod is
enrolled, so the path handed to the rules and to ztunnel (``/proc/<our pid>/fd/<fd>``) stays valid
after the pod's own process or bind mount is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from istio_agent.cni.ambient.settings import PodRedirect
from istio_agent.cni.ambient.zds import EnrolledPod
from istio_agent.cni.kube import KubeClient, KubeError
from istio_agent.log import scope

log = scope("cni-agent")

REDIRECTION = "ambient.istio.io/redirection"
ENABLED = "enabled"
PENDING = "pending"
ANNOTATE_SECONDS = 10.0


class NonRetryableAdd(Exception):
    """The pod cannot be added by trying again (Istio's ``ErrNonRetryableAdd``)."""


class InpodRules(Protocol):
    """The rules inside a pod's namespace (``cni/ambient/inpod.py``); blocking, idempotent."""

    def apply(self, netns: Path, pod: PodRedirect) -> None: ...

    def remove(self, netns: Path) -> None: ...


class HostProbes(Protocol):
    """The host side of kubelet probes (``cni/ambient/hostprobe.py``); blocking."""

    def install(self) -> None: ...

    def add_pod_ips(self, ips: Sequence[str], *, uid: str = "") -> None: ...

    def remove_pod_ips(self, ips: Sequence[str], *, uid: str | None = None) -> None: ...

    def pod_ips(self) -> dict[str, str]:
        """The IPs in the set, with the UID of the pod each was added for."""
        ...

    def uninstall(self) -> None: ...


class Ztunnel(Protocol):
    """The ZDS server (``cni/ambient/zds.py``)."""

    @property
    def connected(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def add(self, pod: EnrolledPod) -> None: ...

    async def delete(self, uid: str) -> None: ...


Annotator = Callable[[Mapping[str, Any], "str | None"], Awaitable[None]]
"""Sets (a value) or removes (None) the pod's ``ambient.istio.io/redirection`` annotation."""
NetnsFinder = Callable[[Collection[str]], Mapping[str, Path]]
"""The network namespace of each pod UID it can find (blocking: a scan of ``/proc``)."""


class KubeAnnotator:
    """The annotation as Istio writes it: a merge patch on ``pods/status`` (less privilege than ``pods``);
    removing it from a pod that is gone is not an error."""

    def __init__(self, client: KubeClient) -> None:
        self._client = client

    async def __call__(self, pod: Mapping[str, Any], value: str | None) -> None:
        meta = pod.get("metadata") or {}
        patch = {"metadata": {"annotations": {REDIRECTION: value}}}
        deadline = time.monotonic() + ANNOTATE_SECONDS
        try:
            await self._client.patch_pod_status(
                meta.get("namespace", ""), meta.get("name", ""), patch, deadline=deadline
            )
        except KubeError as err:
            if value is None and err.status == 404:
                return
            raise


def pod_meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = pod.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def pod_uid(pod: Mapping[str, Any]) -> str:
    return str(pod_meta(pod).get("uid", ""))


def pod_ips(pod: Mapping[str, Any]) -> list[str]:
    """``status.podIPs``, else ``status.podIP`` (Istio's ``GetPodIPsIfPresent``)."""
    status = pod.get("status") or {}
    listed = [
        str(entry.get("ip"))
        for entry in status.get("podIPs") or ()
        if isinstance(entry, Mapping) and entry.get("ip")
    ]
    if listed:
        return listed
    return [str(status["podIP"])] if status.get("podIP") else []


def annotation(pod: Mapping[str, Any]) -> str | None:
    annotations = pod_meta(pod).get("annotations") or {}
    value = annotations.get(REDIRECTION)
    return value if isinstance(value, str) else None


def _workload(pod: Mapping[str, Any], netns: Path | None) -> EnrolledPod:
    meta, spec = pod_meta(pod), pod.get("spec") or {}
    return EnrolledPod(
        uid=pod_uid(pod),
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        service_account=str(spec.get("serviceAccountName") or "default"),
        netns=netns,
    )


class _Entry:
    """An enrolled pod: who it is, its namespace held open (None while unknown), and the IPs put in
    the probe set for it (the plugin's event knows them before the pod's status does)."""

    __slots__ = ("fd", "ips", "pod")

    def __init__(self, pod: Mapping[str, Any], fd: int | None) -> None:
        self.pod = pod
        self.fd = fd
        self.ips: list[str] = []

    @property
    def netns(self) -> Path | None:
        return None if self.fd is None else Path(f"/proc/{os.getpid()}/fd/{self.fd}")

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def _no_finder(uids: Collection[str]) -> Mapping[str, Path]:
    return {}


class Dataplane:
    """The enrolled pods of this node and what enrolling them takes (Istio's ``meshDataplane``)."""

    def __init__(
        self,
        *,
        rules: InpodRules,
        probes: HostProbes,
        ztunnel: Ztunnel,
        annotate: Annotator,
        find_netns: NetnsFinder = _no_finder,
        reconcile: bool = False,
        host_root: Path = Path("/"),
    ) -> None:
        """``host_root``: where the node's file system is mounted (``/host`` in Istio's DaemonSet): a
        plugin event's netns path is the node's, opened under it (Istio's ``openNetnsInRoot``)."""
        self.rules = rules
        self.probes = probes
        self.ztunnel = ztunnel
        self._annotate = annotate
        self._find_netns = find_netns
        self._host_root = host_root
        self.reconcile = reconcile
        """``AMBIENT_RECONCILE_POD_RULES_ON_STARTUP``: the initial snapshot applies the rules again."""
        self._pods: dict[str, _Entry] = {}
        self._busy: dict[str, asyncio.Lock] = {}
        """One operation at a time per pod: the plugin's event and the watch may both act on it."""
        self._users: dict[str, int] = {}

    # -- the snapshot ztunnel gets on (re)connect ------------------------------------------------------

    def snapshot(self) -> list[EnrolledPod]:
        """Every enrolled pod, with its namespace (None: unknown, ztunnel keeps what it has)."""
        return [_workload(entry.pod, entry.netns) for entry in self._pods.values()]

    def enrolled(self, uid: str) -> bool:
        return uid in self._pods

    async def initial_snapshot(self, pods: Sequence[Mapping[str, Any]]) -> None:
        """After a restart: the pods already enrolled (annotated) are enrolled again without being
        touched: their namespaces found in ``/proc``, their IPs in the probe set; with ``reconcile``
        their rules applied again (idempotent: rules already right stay as they are)."""
        found = await asyncio.to_thread(self._find_netns, [pod_uid(pod) for pod in pods])
        for pod in pods:
            uid = pod_uid(pod)
            netns = found.get(uid)
            fd = None
            if netns is not None:
                try:
                    fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as err:
                    log.warning("pod %s: cannot open its netns %s: %s", _name(pod), netns, err)
            else:
                log.warning("pod %s: its netns was not found; ztunnel is asked to keep it", _name(pod))
            entry = _Entry(pod, fd)
            entry.ips = pod_ips(pod)
            self._replace(uid, entry)
        await self._sync_probe_set(pods)
        if self.reconcile:
            for pod in pods:
                entry = self._pods[pod_uid(pod)]
                if entry.netns is None:
                    continue
                try:
                    await asyncio.to_thread(self.rules.apply, entry.netns, _redirect(pod))
                except Exception as err:  # Istio logs it and goes on with the others
                    log.error(
                        "pod %s: failed to reconcile inpod rules, try restarting the pod, or removing and "
                        "re-adding it to the mesh: %s",
                        _name(pod),
                        err,
                    )

    async def _sync_probe_set(self, pods: Sequence[Mapping[str, Any]]) -> None:
        """Istio's ``syncHostAddrSets``: the enrolled pods' IPs in the probe set, any other IP out."""
        expected: set[str] = set()
        for pod in pods:
            ips = pod_ips(pod)
            if not ips:
                log.warning(
                    "pod %s does not appear to have any assigned IPs, not syncing with the probe set",
                    _name(pod),
                )
                continue
            try:
                await asyncio.to_thread(self.probes.add_pod_ips, ips, uid=pod_uid(pod))
            except Exception as err:
                log.error(
                    "pod %s: cannot add its IPs to the probe set, it will fail health checks: %s",
                    _name(pod),
                    err,
                )
                continue
            expected.update(ips)
        try:
            present = await asyncio.to_thread(self.probes.pod_ips)
            stale = sorted(set(present) - expected)
            if stale:
                await asyncio.to_thread(self.probes.remove_pod_ips, stale)
        except Exception as err:
            log.warning("unable to prune the probe set: %s", err)

    # -- add and remove --------------------------------------------------------------------------------

    async def add_pod(self, pod: Mapping[str, Any], ips: Sequence[str], netns: str) -> None:
        """Enroll ``pod`` (see the module); ``netns`` "" means: find it by the pod's UID."""
        async with self._turn(pod_uid(pod)):
            await self._add_pod(pod, ips, netns)

    async def remove_pod(self, pod: Mapping[str, Any], *, deleted: bool) -> None:
        """Unenroll ``pod``: probe set, rules (unless it is being deleted), ztunnel, annotation."""
        async with self._turn(pod_uid(pod)):
            await self._remove_pod(pod, deleted=deleted)

    @contextlib.asynccontextmanager
    async def _turn(self, uid: str) -> AsyncIterator[None]:
        """The pod's lock, forgotten once nobody holds or waits for it."""
        lock = self._busy.setdefault(uid, asyncio.Lock())
        self._users[uid] = self._users.get(uid, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[uid] -= 1
            if not self._users[uid]:
                del self._users[uid], self._busy[uid]

    async def _add_pod(self, pod: Mapping[str, Any], ips: Sequence[str], netns: str) -> None:
        uid, name = pod_uid(pod), _name(pod)
        log.info("pod %s: adding pod to the mesh", name)
        entry = _Entry(pod, None)
        self._replace(uid, entry)
        try:
            entry.fd = await self._open_netns(pod, netns)
        except OSError as err:
            self._forget(uid)
            raise NonRetryableAdd(f"pod {name}: cannot open its network namespace: {err}") from None
        assert entry.netns is not None
        try:
            await asyncio.to_thread(self.rules.apply, entry.netns, _redirect(pod))
        except Exception as err:
            self._forget(uid)
            raise NonRetryableAdd(f"failed to update POD inpod: {name} {err}") from None
        try:
            await self.ztunnel.add(_workload(pod, entry.netns))
        except Exception as err:
            log.error(
                "pod %s: failed to add pod to ztunnel: pod partially added, annotating with pending status",
                name,
            )
            await self._annotate(pod, PENDING)
            raise RuntimeError(f"failed to add pod {name} to ztunnel: {err}") from err
        await asyncio.to_thread(self.probes.add_pod_ips, list(ips), uid=uid)
        entry.ips = list(ips)
        await self._annotate(pod, ENABLED)

    async def _remove_pod(self, pod: Mapping[str, Any], *, deleted: bool) -> None:
        uid, name = pod_uid(pod), _name(pod)
        log.info("pod %s: removing pod from mesh (deleted: %s)", name, deleted)
        entry = self._pods.pop(uid, None)
        ips = list(dict.fromkeys([*pod_ips(pod), *(entry.ips if entry is not None else ())]))
        if ips:
            await asyncio.to_thread(self.probes.remove_pod_ips, ips, uid=uid)
        try:
            if not deleted:
                if entry is not None and entry.netns is not None:
                    await asyncio.to_thread(self.rules.remove, entry.netns)
                else:
                    log.warning("pod %s: netns already gone, not deleting inpod rules", name)
            await self.ztunnel.delete(uid)
        finally:
            if entry is not None:
                entry.close()
        try:
            await self._annotate(pod, None)
        except KubeError as err:
            log.error("pod %s: failed to annotate pod unenrollment: %s", name, err)
            if not deleted:
                raise

    # -- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """The host's probe rules, then the ZDS server."""
        await asyncio.to_thread(self.probes.install)
        await self.ztunnel.start()

    async def stop(self, *, cleanup: bool) -> None:
        """Stop the ZDS server; with ``cleanup`` (not an upgrade) also take the host rules out."""
        await self.ztunnel.stop()
        if cleanup:
            await asyncio.to_thread(self.probes.uninstall)
        for entry in self._pods.values():
            entry.close()
        self._pods.clear()

    async def _open_netns(self, pod: Mapping[str, Any], netns: str) -> int:
        if not netns:
            found = await asyncio.to_thread(self._find_netns, [pod_uid(pod)])
            path = found.get(pod_uid(pod))
            if path is None:
                raise FileNotFoundError(
                    "can't find netns for pod, this is ok if this is a newly created pod (pod not found)"
                )
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # found under the host's /proc already
        return os.open(self._host_root / netns.lstrip("/"), os.O_RDONLY | os.O_CLOEXEC)

    def _replace(self, uid: str, entry: _Entry) -> None:
        old = self._pods.get(uid)
        if old is not None and old is not entry:
            old.close()
        self._pods[uid] = entry

    def _forget(self, uid: str) -> None:
        entry = self._pods.pop(uid, None)
        if entry is not None:
            entry.close()


def _redirect(pod: Mapping[str, Any]) -> PodRedirect:
    annotations = pod_meta(pod).get("annotations") or {}
    return PodRedirect.from_annotations({str(k): str(v) for k, v in annotations.items()})


def _name(pod: Mapping[str, Any]) -> str:
    meta = pod_meta(pod)
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"
