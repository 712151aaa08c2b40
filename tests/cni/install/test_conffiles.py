"""Finding, choosing and editing the node's CNI config files (Istio's cni/pkg/install/cniconfig_test.go cases).

Goldens are ours, written from the format Istio's install-cni produces (keys sorted at every level,
2-space indent, final newline; the standalone file in Istio's field order).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from istio_agent.cni.install import conffiles
from istio_agent.cni.install.conffiles import CniConfigError, NoNetworksError
from istio_agent.cni.install.installer import Check, Installer
from istio_agent.metrics import Registry
from tests.cni.install.layout import DATA, PLUGIN, Node, golden


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def installer(node: Node, **changes: object) -> Installer:
    return Installer(node.settings(**changes), Registry(prefix="istio_"))


# -- finding files ---------------------------------------------------------------------------------


def test_missing_and_empty_directories_have_no_networks(tmp_path: Path) -> None:
    with pytest.raises(NoNetworksError, match="no networks found"):
        conffiles.config_filenames(tmp_path / "missing")
    with pytest.raises(NoNetworksError, match="no networks found"):
        conffiles.config_filenames(tmp_path)
    (tmp_path / "undetectable.file").write_text("{}")
    with pytest.raises(NoNetworksError, match="no networks found"):
        conffiles.config_filenames(tmp_path)
    (tmp_path / "empty.conf").write_text("")
    with pytest.raises(NoNetworksError, match="no valid networks found"):
        conffiles.config_filenames(tmp_path)


def test_valid_files_in_byte_order_and_invalid_ones_skipped_with_why(node: Node) -> None:
    node.put("bridge.conf", "regular.conf")
    assert conffiles.config_filenames(node.conf)[0] == ["regular.conf"]
    node.put("bridge.conf", "regular2.conf")
    (node.conf / "00-not-json.conf").write_text("{nope")
    (node.conf / "01-typeless.conf").write_text('{"name": "x"}')
    (node.conf / "02-nameless.conflist").write_text('{"plugins": [{"type": "bridge"}]}')
    (node.conf / "03-pluginless.conflist").write_text('{"name": "x"}')
    (node.conf / "04-empty-plugins.conflist").write_text('{"name": "x", "plugins": []}')
    (node.conf / "05-dir.conf").mkdir()
    valid, skipped = conffiles.config_filenames(node.conf)
    assert valid == ["regular.conf", "regular2.conf"]
    assert skipped.keys() == {
        "00-not-json.conf",
        "01-typeless.conf",
        "02-nameless.conflist",
        "03-pluginless.conflist",
        "04-empty-plugins.conflist",
    }
    assert "not valid JSON" in skipped["00-not-json.conf"]
    assert skipped["01-typeless.conf"] == "the network config has no type"
    assert skipped["02-nameless.conflist"] == "the network list has no name"


@pytest.mark.timeout(5)  # before the fix, open() of the FIFO blocked until a writer came
def test_a_fifo_or_a_device_is_refused_without_being_waited_on(node: Node) -> None:
    fifo = node.conf / "00-fifo.conflist"
    os.mkfifo(fifo)
    (node.conf / "01-null.conf").symlink_to("/dev/null")
    node.put("calico.conflist", "10-calico.conflist")
    with pytest.raises(CniConfigError, match=r"00-fifo\.conflist is not a regular file"):
        conffiles.read_document(fifo)
    valid, skipped = conffiles.config_filenames(node.conf)
    assert valid == ["10-calico.conflist"]
    assert "is not a regular file" in skipped["00-fifo.conflist"]
    assert "is not a regular file" in skipped["01-null.conf"]
    assert conffiles.load_chained(fifo)[1] == skipped["00-fifo.conflist"]


def test_a_pluginless_list_is_valid_with_a_plugin_directory(node: Node) -> None:
    (node.conf / "10-dir.conflist").write_text('{"name": "net", "cniVersion": "1.0.0"}')
    (node.conf / "net").mkdir()
    (node.conf / "net" / "10-bridge.conf").write_text('{"type": "bridge"}')
    assert conffiles.config_filenames(node.conf)[0] == ["10-dir.conflist"]


def test_numbers_read_as_go_reads_them_and_nan_refused() -> None:
    assert conffiles.parse(b'{"a": 1, "b": 1.5}') == {"a": 1.0, "b": 1.5}
    with pytest.raises(ValueError):
        conffiles.parse(b'{"a": NaN}')
    with pytest.raises(ValueError, match="out of range"):
        conffiles.parse(b'{"a": 1e999}')


# -- choosing the file ----------------------------------------------------------------------------


def test_a_configured_name_resolves_to_its_twin(node: Node) -> None:
    node.put("calico.conflist", "list.conflist")
    node.put("bridge.conf")
    assert conffiles.resolve_name(node.conf, "list.conflist") == node.conf / "list.conflist"
    assert conffiles.resolve_name(node.conf, "list.conf") == node.conf / "list.conflist"
    assert conffiles.resolve_name(node.conf, "bridge.conflist") == node.conf / "bridge.conf"
    assert conffiles.resolve_name(node.conf, "never-created.conf") is None


async def test_unspecified_name_takes_the_first_valid_file(node: Node) -> None:
    node.put("bridge.conf")
    node.put("calico.conflist", "list.conflist")
    path = await installer(node).create_config_file()
    assert path == node.conf / "bridge.conflist"
    assert not (node.conf / "bridge.conf").exists()
    golden("bridge.conflist", path.read_bytes())


async def test_chaining_waits_for_a_delayed_file_then_takes_it(node: Node) -> None:
    task = asyncio.create_task(installer(node).create_config_file())
    await asyncio.sleep(0.05)
    assert not task.done()
    node.put("bridge.conf")
    assert await asyncio.wait_for(task, 5) == node.conf / "bridge.conflist"


async def test_a_named_file_never_created_waits_until_cancelled(node: Node) -> None:
    node.put("bridge.conf")
    task = asyncio.create_task(installer(node, cni_conf_name="never-created.conf").create_config_file())
    await asyncio.sleep(0.05)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(p.name for p in node.conf.iterdir()) == ["bridge.conf"]


@pytest.mark.parametrize("name", ["list.conflist", "list.conf"])
async def test_a_named_list_gets_our_entry_last(node: Node, name: str) -> None:
    node.put("calico.conflist", "list.conflist", mode=0o644)
    path = await installer(node, cni_conf_name=name).create_config_file()
    assert path == node.conf / "list.conflist"
    golden("calico.conflist", path.read_bytes())
    assert path.stat().st_mode & 0o777 == 0o644  # the existing file's mode is kept


async def test_a_named_conf_becomes_a_conflist(node: Node) -> None:
    node.put("minikube.conf", "minikube.conf", mode=0o640)
    path = await installer(node, cni_conf_name="minikube.conflist").create_config_file()
    assert path == node.conf / "minikube.conflist"
    assert sorted(p.name for p in node.conf.iterdir()) == ["minikube.conflist"]
    assert path.stat().st_mode & 0o777 == 0o640
    golden("minikube.conflist", path.read_bytes())


async def test_an_old_entry_of_ours_is_replaced_and_the_order_kept(node: Node) -> None:
    node.put("list-with-istio.conflist")
    path = await installer(node).create_config_file()
    golden("list-with-istio.conflist", path.read_bytes())
    document = conffiles.read_document(path)
    assert [p["type"] for p in document["plugins"]] == ["ptp", "portmap", "istio-cni"]


async def test_a_named_file_that_is_not_a_cni_config_is_written_in_place(node: Node) -> None:
    (node.conf / "undetectable.file").write_text((DATA / "calico.conflist").read_text())
    path = await installer(node, cni_conf_name="undetectable.file").create_config_file()
    assert path == node.conf / "undetectable.file"
    assert conffiles.istio_entries(conffiles.read_document(path)) == [2]


@pytest.mark.parametrize("name", ["", "specific-name.conf"])
async def test_standalone_writes_our_own_file_without_waiting(node: Node, name: str) -> None:
    path = await installer(node, chained_cni_plugin=False, cni_conf_name=name).create_config_file()
    assert path == node.conf / (name or "YYY-istio-cni.conf")
    golden("YYY-istio-cni.conf", path.read_bytes())
    assert path.stat().st_mode & 0o777 == 0o600


async def test_standalone_group_read_mode(node: Node) -> None:
    path = await installer(node, chained_cni_plugin=False, cni_conf_group_read=True).create_config_file()
    assert path is not None and path.stat().st_mode & 0o777 == 0o640


# -- inserting and removing ------------------------------------------------------------------------


@pytest.mark.parametrize("document", [{}, [], "text"])
def test_insert_refuses_documents_without_a_plugin_list(document: object) -> None:
    with pytest.raises(CniConfigError):
        conffiles.insert_entry(document, conffiles.entry(PLUGIN))


def test_insert_then_remove_gives_back_the_list() -> None:
    original = conffiles.read_document(DATA / "calico.conflist")
    inserted = conffiles.insert_entry(original, conffiles.entry(PLUGIN))
    assert conffiles.remove_entry(inserted) == original


def test_the_chained_output_escapes_as_go_and_keeps_big_numbers_as_float64() -> None:
    text = conffiles.marshal(conffiles.read_document(DATA / "list-with-istio.conflist")).decode()
    assert '"note": "\\u003ckeep \\u0026 order\\u003e"' in text
    assert '"city": "Zürich"' in text
    assert '"big": 12345678901234567000' in text
    assert '"tiny": 1e-7' in text


# -- the validity check ----------------------------------------------------------------------------


async def test_check_after_install_and_after_changes(node: Node) -> None:
    node.put("calico.conflist", "10-calico.conflist")
    inst = installer(node)
    assert inst.check().check is Check.REWRITE  # not installed yet
    inst.config_path = await inst.create_config_file()
    assert inst.check().check is Check.OK
    node.put("calico.conflist", "10-calico.conflist")  # our entry removed
    verdict = inst.check()
    assert verdict.check is Check.REWRITE and verdict.repair
    assert "istio-cni CNI config removed" in verdict.reason
    inst.config_path = await inst.create_config_file()
    node.put("bridge.conf", "05-bridge.conf")  # preempted by an earlier file (name not configured)
    verdict = inst.check()
    assert verdict.check is Check.REWRITE and "preempted" in verdict.reason
    (node.conf / "05-bridge.conf").unlink()
    (node.conf / "10-calico.conflist").unlink()
    assert inst.check().check is Check.REWRITE


async def test_check_with_a_configured_name_only_warns_when_preempted(node: Node) -> None:
    node.put("calico.conflist", "list.conflist")
    inst = installer(node, cni_conf_name="list.conflist")
    inst.config_path = await inst.create_config_file()
    node.put("bridge.conf", "01-bridge.conf")
    assert inst.check().check is Check.OK


async def test_check_a_changed_entry_of_ours_needs_a_rewrite(node: Node) -> None:
    node.put("calico.conflist", "10-calico.conflist")
    inst = installer(node)
    inst.config_path = await inst.create_config_file()
    text = inst.config_path.read_text().replace('"plugin_log_level": "debug"', '"plugin_log_level": "info"')
    inst.config_path.write_text(text)
    verdict = inst.check()
    assert verdict.check is Check.REWRITE and "differs" in verdict.reason


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"name": "k8s-pod-network", "plugins": []}',
        '{"name": "n", "plugins": [{"type": ""}]}',
        "[]",
    ],
)
async def test_check_a_corrupt_file_we_chained_into_is_corrupt_not_rewritten(
    node: Node, content: str
) -> None:
    node.put("calico.conflist", "10-calico.conflist")
    node.put("bridge.conf", "20-bridge.conf")  # a valid file after it: Istio would move there
    inst = installer(node)
    inst.config_path = await inst.create_config_file()
    inst.config_path.write_text(content)
    verdict = inst.check()
    assert verdict.check is Check.CORRUPT
    assert "corrupt and left alone" in verdict.reason


def test_check_standalone(node: Node) -> None:
    inst = installer(node, chained_cni_plugin=False)
    inst.config_path = node.put("bridge.conf", "YYY-istio-cni.conf")
    assert inst.check().check is Check.REWRITE
    inst.config_path.write_bytes(conffiles.standalone_text(PLUGIN))
    assert inst.check().check is Check.OK
