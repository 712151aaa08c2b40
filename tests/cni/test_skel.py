"""The CNI contract in-process: each error code, the version rules, what is printed and the exit status."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from istio_agent.cni import skel

BASE_ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "abc",
    "CNI_NETNS": "/var/run/netns/x",
    "CNI_IFNAME": "eth0",
    "CNI_PATH": "/opt/cni/bin",
}
CONFIG = {"cniVersion": "1.0.0", "name": "net", "type": "istio-cni"}


def call(
    env: dict[str, str], stdin: bytes | dict[str, Any], handled: list[str] | None = None
) -> tuple[int, str]:
    seen = handled if handled is not None else []

    def handler(args: skel.CmdArgs) -> dict[str, Any] | None:
        seen.append(args.command)
        return {"cniVersion": args.cni_version, "dns": {}} if args.command == "ADD" else None

    out = io.StringIO()
    data = json.dumps(stdin).encode() if isinstance(stdin, dict) else stdin
    code = skel.main(
        {"ADD": handler, "CHECK": handler, "DEL": handler},
        about="CNI plugin test",
        environ=env,
        stdin=io.BytesIO(data),
        stdout=out,
        stderr=io.StringIO(),
    )
    return code, out.getvalue()


def error(env: dict[str, str], stdin: bytes | dict[str, Any] = CONFIG) -> dict[str, Any]:
    code, out = call(env, stdin)
    assert code == 1
    result: dict[str, Any] = json.loads(out)
    return result


def run_add_with(handler: skel.Handler) -> tuple[int, str, str]:
    """An ADD of CONFIG through ``handler``: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    code = skel.main(
        {"ADD": handler},
        about="x",
        environ=BASE_ENV,
        stdin=io.BytesIO(json.dumps(CONFIG).encode()),
        stdout=out,
        stderr=err,
    )
    return code, out.getvalue(), err.getvalue()


def test_add_prints_the_handlers_result_indented() -> None:
    code, out = call(BASE_ENV, CONFIG)
    assert code == 0
    assert out == '{\n    "cniVersion": "1.0.0",\n    "dns": {}\n}'


@pytest.mark.parametrize(
    ("command", "missing"),
    [
        ("ADD", ["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"]),
        ("CHECK", ["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"]),
        ("DEL", ["CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH"]),
        ("GC", ["CNI_PATH"]),
        ("STATUS", ["CNI_PATH"]),
    ],
)
def test_required_env_per_command(command: str, missing: list[str]) -> None:
    assert error({"CNI_COMMAND": command}) == {
        "code": 4,
        "msg": f"required env variables [{','.join(missing)}] missing",
    }


def test_del_does_not_need_the_netns() -> None:
    env = {k: v for k, v in BASE_ENV.items() if k != "CNI_NETNS"}
    assert call({**env, "CNI_COMMAND": "DEL"}, CONFIG) == (0, "")


def test_unknown_command_is_code_4() -> None:
    assert error({**BASE_ENV, "CNI_COMMAND": "FROB"}) == {"code": 4, "msg": "unknown CNI_COMMAND: FROB"}


@pytest.mark.parametrize(
    ("ifname", "msg"),
    [
        ("a" * 16, "interface name is too long"),
        ("..", "interface name is . or .."),
        ("eth/0", "interface name contains / or : or whitespace characters"),
        ("eth 0", "interface name contains / or : or whitespace characters"),
    ],
)
def test_bad_interface_name_is_code_4(ifname: str, msg: str) -> None:
    assert error({**BASE_ENV, "CNI_IFNAME": ifname})["msg"] == msg


def test_bad_container_id_is_code_4() -> None:
    assert error({**BASE_ENV, "CNI_CONTAINERID": "-bad id"})["code"] == 4


@pytest.mark.parametrize("stdin", [b"", b"{", b"[1, 2]", b"\xff\xfe", b"null"])
def test_stdin_that_is_no_json_object_is_code_6(stdin: bytes) -> None:
    result = error(BASE_ENV, stdin)
    assert result["code"] == 6 and result["msg"].startswith("error unmarshall network config")


@pytest.mark.parametrize(
    ("config", "msg"),
    [
        ({"cniVersion": "1.0.0"}, "missing network name"),
        ({"cniVersion": "1.0.0", "name": ""}, "missing network name"),
        ({"cniVersion": "1.0.0", "name": 7}, "missing network name"),
        ({"cniVersion": "1.0.0", "name": "bad name!"}, "invalid characters found in network name"),
    ],
)
def test_bad_network_name_is_code_7(config: dict[str, Any], msg: str) -> None:
    assert error(BASE_ENV, config)["code"] == 7
    assert error(BASE_ENV, config)["msg"] == msg


def test_unsupported_version_is_code_1_naming_what_is_supported() -> None:
    result = error(BASE_ENV, {**CONFIG, "cniVersion": "9.9.9"})
    assert result["code"] == 1 and result["msg"] == "incompatible CNI versions"
    assert '"9.9.9"' in result["details"] and "1.1.0" in result["details"]


def test_missing_version_means_0_1_0() -> None:
    code, out = call(BASE_ENV, {"name": "net"})
    assert code == 0 and json.loads(out)["cniVersion"] == "0.1.0"


def test_check_needs_0_4_0() -> None:
    env = {**BASE_ENV, "CNI_COMMAND": "CHECK"}
    assert error(env, {**CONFIG, "cniVersion": "0.3.1"})["code"] == 1
    assert call(env, {**CONFIG, "cniVersion": "0.4.0"}) == (0, "")


@pytest.mark.parametrize("command", ["GC", "STATUS"])
def test_gc_and_status_need_1_1_0_and_succeed_silently(command: str) -> None:
    env = {"CNI_COMMAND": command, "CNI_PATH": "/opt/cni/bin"}
    assert error(env, CONFIG)["code"] == 1
    handled: list[str] = []
    assert call(env, {**CONFIG, "cniVersion": "1.1.0"}, handled) == (0, "")
    assert handled == []


def test_handler_error_is_printed_as_given() -> None:
    def failing(args: skel.CmdArgs) -> None:
        raise skel.CniError(skel.ERR_INTERNAL, "pod <x> & co")

    code, out, _ = run_add_with(failing)
    assert code == 1
    assert out == '{\n    "code": 999,\n    "msg": "pod \\u003cx\\u003e \\u0026 co"\n}'


@pytest.mark.parametrize("command", ["ADD", "CHECK", "DEL"])
def test_the_plugins_own_netns_is_code_8(command: str) -> None:
    env = {**BASE_ENV, "CNI_COMMAND": command, "CNI_NETNS": "/proc/self/ns/net"}
    assert error(env)["code"] == 8
    assert call({**env, "CNI_NETNS_OVERRIDE": "1"}, CONFIG)[0] == 0


def test_go_json_escapes_line_and_paragraph_separators_as_go_does() -> None:
    # Go's encoding/json escapes U+2028 and U+2029 even where it writes other non-ASCII raw.
    text = skel.go_json({"msg": "a\u2028b\u2029c é <&>"})
    assert text == '{\n    "msg": "a\\u2028b\\u2029c é \\u003c\\u0026\\u003e"\n}'
    assert json.loads(text) == {"msg": "a\u2028b\u2029c é <&>"}


def test_an_unexpected_exception_is_an_error_result_with_one_traceback_on_stderr() -> None:
    def buggy(args: skel.CmdArgs) -> None:
        raise ValueError("bad <value>")

    code, out, err = run_add_with(buggy)
    assert code == 1
    assert json.loads(out) == {"code": 999, "msg": "bad <value>"}
    assert err.count("Traceback (most recent call last)") == 1
    assert "ValueError: bad <value>" in err


def test_an_unexpected_exception_without_a_message_is_named_by_its_type() -> None:
    def buggy(args: skel.CmdArgs) -> None:
        raise KeyError

    code, out, _ = run_add_with(buggy)
    assert (code, json.loads(out)) == (1, {"code": 999, "msg": "KeyError"})


def test_a_result_that_cannot_be_written_is_an_error_result_not_half_a_document() -> None:
    code, out, _ = run_add_with(lambda args: {"cniVersion": "1.0.0", "bad": object()})
    assert code == 1 and json.loads(out)["code"] == 999
