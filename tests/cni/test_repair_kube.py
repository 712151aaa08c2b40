"""The API client's repair calls (``cni/kube.py``) against the FAKE API server (``fake_kube.py``), which
must answer and refuse as the real Kubernetes API server does: selectors, watch semantics (versions,
410 Gone, filter transitions, bookmarks, the end of a watch), delete preconditions and graceful
deletion, ``pods/status`` merge patches, Events, RBAC and authentication."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from istio_agent.cni.kube import KubeClient, KubeError, WatchEvent, parse_kubeconfig
from istio_agent.http.client import Client
from tests.cni.fake_kube import TOKEN, FakeKube, sidecar_pod, start_fake_kube


def soon() -> float:
    return time.monotonic() + 5


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[FakeKube, KubeClient]]:
    fake, runner = await start_fake_kube(tmp_path)
    try:
        yield fake, KubeClient(parse_kubeconfig(fake.kubeconfig(), "test"))
    finally:
        await runner.cleanup()


def pod(name: str, node: str | None = "node-1", **labels: str) -> dict[str, Any]:
    return sidecar_pod(name, labels=labels, node_name=node)


async def collect(events: AsyncIterator[WatchEvent], count: int) -> list[WatchEvent]:
    out = []
    async with asyncio.timeout(5):
        async for event in events:
            out.append(event)
            if len(out) == count:
                break
    return out


async def test_list_selects_by_node_and_labels(api: tuple[FakeKube, KubeClient]) -> None:
    fake, client = api
    fake.add_pod(pod("a", app="web", tier="front"))
    fake.add_pod(pod("b", app="db"))
    fake.add_pod(pod("c", node="node-2", app="web"))
    fake.add_pod(pod("d", node=None, app="web"))
    names = lambda listed: sorted(p["metadata"]["name"] for p in listed.items)  # noqa: E731
    assert names(await client.list_pods(field_selector="spec.nodeName=node-1", deadline=soon())) == ["a", "b"]
    assert names(await client.list_pods(field_selector="spec.nodeName=", deadline=soon())) == ["d"]
    both = await client.list_pods(label_selector="app in (web,db),!tier", deadline=soon())
    assert names(both) == ["b", "c", "d"]
    assert names(await client.list_pods(label_selector="app!=web", deadline=soon())) == ["b"]
    listed = await client.list_pods(deadline=soon())
    assert listed.resource_version == str(fake.version)
    assert "kind" not in listed.items[0]  # list items carry no kind, as the real server's


@pytest.mark.parametrize(
    ("labels", "fields", "message"),
    [
        ("app in ()", "", "values set can't be empty"),
        ("app=web,", "", "expected: identifier"),
        ("a b", "", "found 'b', expected: in, notin"),
        ("-x=1", "", "name part must consist of"),
        ("", "spec.nodeNameX=a", "field label not supported: spec.nodeNameX"),
        ("", "spec.nodeName", "can't understand"),
    ],
)
async def test_bad_selectors_are_400(
    api: tuple[FakeKube, KubeClient], labels: str, fields: str, message: str
) -> None:
    _, client = api
    with pytest.raises(KubeError, match=message) as caught:
        await client.list_pods(label_selector=labels, field_selector=fields, deadline=soon())
    assert caught.value.status == 400 and not caught.value.retryable


async def test_watch_from_a_version_sees_each_change_and_filter_transitions(
    api: tuple[FakeKube, KubeClient],
) -> None:
    fake, client = api
    fake.add_pod(pod("a"))
    start = (await client.list_pods(field_selector="spec.nodeName=node-1", deadline=soon())).resource_version
    fake.add_pod(pod("b"))  # before the watch opens: replayed from the history
    events = client.watch_pods(
        resource_version=start, field_selector="spec.nodeName=node-1", timeout_seconds=30
    )
    watching = asyncio.ensure_future(collect(events, 5))
    await asyncio.sleep(0.2)
    fake.update_pod("default", "a", {"status": {"phase": "Running"}})
    fake.add_pod(pod("elsewhere", node="node-2"))  # never seen
    fake.update_pod("default", "b", {"spec": {"nodeName": "node-2"}})  # leaves the selection: DELETED
    fake.update_pod("default", "b", {"spec": {"nodeName": "node-1"}})  # comes back: ADDED
    fake.finish_deletion("default", "a")
    seen = [(e.type, e.object["metadata"]["name"]) for e in await watching]
    assert seen == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b"), ("ADDED", "b"), ("DELETED", "a")]
    versions = [int(e.resource_version) for e in await collect_all(fake, client, start)]
    assert versions == sorted(versions)


async def collect_all(fake: FakeKube, client: KubeClient, start: str) -> list[WatchEvent]:
    """Everything after ``start`` on the node, replayed by a new watch (which then ends)."""
    events = client.watch_pods(
        resource_version=start, field_selector="spec.nodeName=node-1", timeout_seconds=1
    )
    return [event async for event in events]


async def test_a_watch_from_version_0_starts_with_the_current_pods(api: tuple[FakeKube, KubeClient]) -> None:
    fake, client = api
    fake.add_pod(pod("a"))
    seen = [
        (e.type, e.object["metadata"]["name"], e.object["kind"])
        async for e in client.watch_pods(resource_version="0", timeout_seconds=1)
    ]
    assert seen == [("ADDED", "a", "Pod")]


async def test_a_compacted_version_is_410_gone(api: tuple[FakeKube, KubeClient]) -> None:
    fake, client = api
    fake.add_pod(pod("a"))
    old = (await client.list_pods(deadline=soon())).resource_version
    fake.add_pod(pod("b"))
    fake.compact()
    with pytest.raises(KubeError, match="too old resource version") as caught:
        await collect(client.watch_pods(resource_version=old, timeout_seconds=5), 1)
    assert caught.value.gone and caught.value.reason == "Expired"


async def test_a_watch_ends_after_its_timeout_and_bookmarks_move_the_version(
    api: tuple[FakeKube, KubeClient],
) -> None:
    fake, client = api
    fake.add_pod(pod("a"))
    start = (await client.list_pods(deadline=soon())).resource_version
    began = time.monotonic()
    events = client.watch_pods(resource_version=start, timeout_seconds=1)
    bookmark = asyncio.get_running_loop().call_later(0.3, fake.bookmark)
    seen = [event async for event in events]
    bookmark.cancel()
    assert 0.9 < time.monotonic() - began < 3
    assert [(e.type, e.resource_version) for e in seen] == [("BOOKMARK", start)]


async def test_a_dropped_watch_is_a_retryable_error(api: tuple[FakeKube, KubeClient]) -> None:
    fake, client = api
    start = (await client.list_pods(deadline=soon())).resource_version
    events = client.watch_pods(resource_version=start, timeout_seconds=30)
    asyncio.get_running_loop().call_later(0.3, fake.drop_watches)
    with pytest.raises(KubeError) as caught:
        await collect(events, 1)
    assert caught.value.retryable and caught.value.status is None


async def test_delete_preconditions_and_graceful_deletion(api: tuple[FakeKube, KubeClient]) -> None:
    fake, client = api
    stored = fake.add_pod(pod("a"))
    uid, version = stored["metadata"]["uid"], stored["metadata"]["resourceVersion"]
    fake.update_pod("default", "a", {"status": {"phase": "Pending"}})
    with pytest.raises(KubeError, match="Precondition failed: ResourceVersion in precondition") as stale:
        await client.delete_pod("default", "a", uid=uid, resource_version=version, deadline=soon())
    assert stale.value.status == 409 and stale.value.reason == "Conflict" and not stale.value.retryable
    current = fake.pods[("default", "a")]["metadata"]["resourceVersion"]
    with pytest.raises(KubeError, match="Precondition failed: UID in precondition: other") as other:
        await client.delete_pod("default", "a", uid="other", resource_version=current, deadline=soon())
    assert other.value.status == 409
    answer = await client.delete_pod("default", "a", uid=uid, resource_version=current, deadline=soon())
    assert answer["metadata"]["deletionGracePeriodSeconds"] == 30  # bound to a node: the kubelet stops it
    assert "deletionTimestamp" in fake.pods[("default", "a")]["metadata"]
    fake.finish_deletion("default", "a")
    with pytest.raises(KubeError, match='pods "a" not found') as gone:
        await client.delete_pod("default", "a", uid=uid, resource_version=current, deadline=soon())
    assert gone.value.status == 404
    unbound = fake.add_pod(pod("u", node=None))
    meta = unbound["metadata"]
    await client.delete_pod(
        "default", "u", uid=meta["uid"], resource_version=meta["resourceVersion"], deadline=soon()
    )
    assert ("default", "u") not in fake.pods  # never scheduled: gone at once


async def test_status_merge_patch_labels_the_pod_but_never_changes_its_spec(
    api: tuple[FakeKube, KubeClient],
) -> None:
    fake, client = api
    fake.add_pod(pod("a", app="web"))
    before = fake.version
    patch = {"metadata": {"labels": {"cni.istio.io/uninitialized": "true"}}, "spec": {"nodeName": "x"}}
    answer = await client.patch_pod_status("default", "a", patch, deadline=soon())
    assert answer["metadata"]["labels"] == {"app": "web", "cni.istio.io/uninitialized": "true"}
    assert answer["spec"]["nodeName"] == "node-1"
    assert fake.version == before + 1
    await client.patch_pod_status("default", "a", {"metadata": {"labels": {"app": "web"}}}, deadline=soon())
    assert fake.version == before + 1  # nothing changed: no new version, no watch event
    with pytest.raises(KubeError, match=r"metadata\.labels: Invalid value") as invalid:
        await client.patch_pod_status("default", "a", {"metadata": {"labels": {"k": "a b"}}}, deadline=soon())
    assert invalid.value.status == 422
    stale = {"metadata": {"resourceVersion": "1", "labels": {"x": "y"}}}
    with pytest.raises(KubeError, match="the object has been modified") as conflict:
        await client.patch_pod_status("default", "a", stale, deadline=soon())
    assert conflict.value.status == 409
    with pytest.raises(KubeError, match="not found"):
        await client.patch_pod_status("default", "nope", patch, deadline=soon())


@pytest.mark.parametrize(("media", "status"), [("application/json", 415), ("text/plain", 415)])
async def test_a_patch_in_another_media_type_is_refused(
    api: tuple[FakeKube, KubeClient], media: str, status: int
) -> None:
    fake, _ = api
    fake.add_pod(pod("a"))
    url = f"https://127.0.0.1:{fake.port}/api/v1/namespaces/default/pods/a/status"
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": media}
    answer = await Client(tls=_trust(fake)).fetch("PATCH", url, headers=headers, body=b'{"metadata": {}}')
    assert answer.status == status
    assert json.loads(answer.body)["reason"] == "UnsupportedMediaType"


def _trust(fake: FakeKube) -> Any:
    import ssl

    return ssl.create_default_context(cadata=fake.ca_pem.decode())


async def test_events_are_validated_and_patched(api: tuple[FakeKube, KubeClient]) -> None:
    fake, client = api
    event = {
        "kind": "Event",
        "apiVersion": "v1",
        "metadata": {"name": "a.1", "namespace": "default"},
        "involvedObject": {"kind": "Pod", "namespace": "default", "name": "a"},
        "reason": "R",
        "message": "m",
        "type": "Warning",
        "count": 1,
    }
    created = await client.create_event("default", event, deadline=soon())
    assert created["metadata"]["uid"]
    with pytest.raises(KubeError, match="already exists") as duplicate:
        await client.create_event("default", event, deadline=soon())
    assert duplicate.value.status == 409
    elsewhere = {**event, "metadata": {"name": "a.2"}, "involvedObject": {"namespace": "other"}}
    with pytest.raises(KubeError, match=r"does not match event\.namespace") as mismatch:
        await client.create_event("default", elsewhere, deadline=soon())
    assert mismatch.value.status == 422
    with pytest.raises(KubeError, match="Required value"):
        await client.create_event("default", {**event, "metadata": {}}, deadline=soon())
    await client.patch_event("default", "a.1", {"count": 2}, deadline=soon())
    assert fake.events[("default", "a.1")]["count"] == 2
    with pytest.raises(KubeError, match="not found"):
        await client.patch_event("default", "a.9", {"count": 2}, deadline=soon())


async def test_rbac_denials_and_a_wrong_token(api: tuple[FakeKube, KubeClient]) -> None:
    fake, client = api
    stored = fake.add_pod(pod("a"))
    fake.forbidden.add(("delete", "pods"))
    meta = stored["metadata"]
    with pytest.raises(KubeError, match='cannot delete resource "pods"') as denied:
        await client.delete_pod(
            "default", "a", uid=meta["uid"], resource_version=meta["resourceVersion"], deadline=soon()
        )
    assert denied.value.status == 403 and not denied.value.retryable
    fake.forbidden.add(("patch", "pods/status"))
    with pytest.raises(KubeError, match='cannot patch resource "pods" subresource "status"'):
        await client.patch_pod_status("default", "a", {}, deadline=soon())
    stranger = KubeClient(parse_kubeconfig(fake.kubeconfig(), "test")._replace(token="wrong"))
    with pytest.raises(KubeError, match="401") as unauthorized:
        await stranger.list_pods(deadline=soon())
    assert unauthorized.value.status == 401


async def test_the_token_file_is_read_for_each_request(
    api: tuple[FakeKube, KubeClient], tmp_path: Path
) -> None:
    fake, _ = api
    token = tmp_path / "token"
    token.write_text("stale\n")
    client = KubeClient(parse_kubeconfig(fake.kubeconfig(), "test")._replace(token="", token_file=token))
    with pytest.raises(KubeError, match="401"):
        await client.list_pods(deadline=soon())
    token.write_text(TOKEN + "\n")  # rotated by the kubelet
    await client.list_pods(deadline=soon())
    token.unlink()
    with pytest.raises(KubeError, match="cannot read the token") as missing:
        await client.list_pods(deadline=soon())
    assert missing.value.retryable
