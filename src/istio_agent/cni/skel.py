"""The CNI plugin contract: the CNI_* env vars, the command dispatch, the version check, error results.

A container runtime execs the plugin once per command with its arguments in the environment and the
network config on stdin, and reads one JSON document from stdout. What the runtime sees when
something is wrong is the contract, so the codes, the checks and their order are those of the
reference library Istio's plugin is built on (``containernetworking/cni``, ``pkg/skel``): env vars
first (code 4), then the config (6: not JSON, 7: no valid ``name``), then the version (1). Errors
are printed as that library prints them (4-space indented JSON on stdout) and the process exits 1.

Kept free of asyncio, logging and the agent's other packages, and imports at run time only ``os``
(``json`` once there is JSON to read or write): ``VERSION`` costs no more than the interpreter's
start, which the runtime pays on every pod sandbox.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any, BinaryIO, TextIO

SUPPORTED_VERSIONS = ("0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
CURRENT_VERSION = "1.1.0"
DEFAULT_CONFIG_VERSION = "0.1.0"
"""What a config without ``cniVersion`` means (the CNI spec's first version)."""

ERR_INCOMPATIBLE_VERSION = 1
ERR_UNKNOWN_CONTAINER = 3
ERR_INVALID_ENV = 4
ERR_DECODING = 6
ERR_INVALID_CONFIG = 7
ERR_INVALID_NETNS = 8
ERR_INTERNAL = 999
"""A handler's error (Istio's plugin returns plain errors, which the library reports as 999)."""

COMMANDS = ("ADD", "CHECK", "DEL", "VERSION", "GC", "STATUS")
_REQUIRED = {
    "CNI_CONTAINERID": ("ADD", "CHECK", "DEL"),
    "CNI_NETNS": ("ADD", "CHECK"),
    "CNI_IFNAME": ("ADD", "CHECK", "DEL"),
    "CNI_PATH": ("ADD", "CHECK", "DEL", "GC", "STATUS"),
}
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_NAME_CHARS = _ALNUM | frozenset("_.-")
_MAX_IFNAME = 15


class CniError(Exception):
    """A CNI error result: ``code`` and ``msg`` (and ``details``) as the runtime will read them."""

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.details = details

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "msg": self.msg}
        if self.details:
            out["details"] = self.details
        return out


class CmdArgs:
    """One invocation: the command, its CNI_* values and the network config (parsed: a JSON object
    with a valid ``name``)."""

    def __init__(
        self,
        *,
        command: str,
        container_id: str,
        netns: str,
        ifname: str,
        args: str,
        path: str,
        stdin: bytes,
        config: Mapping[str, Any],
        cni_version: str,
    ) -> None:
        self.command = command
        self.container_id = container_id
        self.netns = netns
        self.ifname = ifname
        self.args = args
        self.path = path
        self.stdin = stdin
        self.config = config
        self.cni_version = cni_version


if TYPE_CHECKING:
    Handler = Callable[[CmdArgs], "dict[str, Any] | None"]
    """Runs one command; returns the result to print (ADD), or None (CHECK, DEL: nothing printed)."""


def _valid_name(name: str) -> bool:
    """The library's rule for network names and container ids: ``[a-zA-Z0-9][a-zA-Z0-9_.-]*``."""
    return name != "" and name[0] in _ALNUM and all(ch in _NAME_CHARS for ch in name)


_GO_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def go_json(value: object) -> str:
    """JSON as Go's ``json.MarshalIndent(v, "", "    ")`` writes it: ``<``, ``>``, ``&`` and the line and
    paragraph separators U+2028/U+2029 escaped (raw, they end a line in JavaScript), the rest as is.

    A second Go-style writer beside ``goformat.json_marshal``, on purpose: this module is what the
    exec'd plugin loads for every pod, and ``goformat`` imports ``enum``, ``signal``, ``datetime`` and
    ``decimal`` for its other jobs, which would add to that start-up; this one needs only ``json``
    (only CNI results and error results, JSON read by ``json`` and strings, go through it).
    """
    import json

    return json.dumps(value, indent=4, ensure_ascii=False).translate(_GO_ESCAPES)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _validate_ifname(name: str) -> None:
    """The interface name rules of the CNI library (Linux's: at most 15 bytes, no ``/``, ``:`` or space)."""
    if name == "":
        raise CniError(ERR_INVALID_ENV, "interface name is empty")
    if len(name.encode()) > _MAX_IFNAME:
        raise CniError(
            ERR_INVALID_ENV,
            "interface name is too long",
            f"interface name should be less than {_MAX_IFNAME + 1} characters",
        )
    if name in (".", ".."):
        raise CniError(ERR_INVALID_ENV, "interface name is . or ..")
    if any(ch in "/:" or ch.isspace() for ch in name):
        raise CniError(ERR_INVALID_ENV, "interface name contains / or : or whitespace characters")


def read_args(environ: Mapping[str, str], stdin: bytes) -> CmdArgs:
    """The invocation from the env and stdin, checked in the library's order; raises CniError."""
    command = environ.get("CNI_COMMAND", "")
    if command not in COMMANDS:
        raise CniError(ERR_INVALID_ENV, f"unknown CNI_COMMAND: {command}")
    missing = [name for name, commands in _REQUIRED.items() if command in commands and not environ.get(name)]
    if missing:
        raise CniError(ERR_INVALID_ENV, f"required env variables [{','.join(missing)}] missing")
    container_id = environ.get("CNI_CONTAINERID", "")
    if command in _REQUIRED["CNI_CONTAINERID"] and not _valid_name(container_id):
        raise CniError(ERR_INVALID_ENV, "invalid characters in containerID", container_id)
    ifname = environ.get("CNI_IFNAME", "")
    if command in _REQUIRED["CNI_IFNAME"]:
        _validate_ifname(ifname)
    config: Mapping[str, Any] = {}
    version = CURRENT_VERSION
    if command != "VERSION":
        config = parse_config(stdin)
        version = config_version(config)
    netns = environ.get("CNI_NETNS", "")
    if command in ("ADD", "CHECK", "DEL") and netns and not environ.get("CNI_NETNS_OVERRIDE"):
        _check_not_own_netns(netns)
    return CmdArgs(
        command=command,
        container_id=container_id,
        netns=environ.get("CNI_NETNS", ""),
        ifname=ifname,
        args=environ.get("CNI_ARGS", ""),
        path=environ.get("CNI_PATH", ""),
        stdin=stdin,
        config=config,
        cni_version=version,
    )


def _check_not_own_netns(netns: str) -> None:
    """A runtime bug (or a test) handing the plugin its own, the host's, netns must not get the host's
    rules changed: refused unless CNI_NETNS_OVERRIDE says it is meant. A path that does not resolve is
    the handler's concern (a pod that needs no rules does not need its netns)."""
    try:
        given, own = os.stat(netns), os.stat("/proc/self/ns/net")
    except (OSError, ValueError):  # ValueError: a NUL byte, which no path has
        return
    if (given.st_dev, given.st_ino) == (own.st_dev, own.st_ino):
        raise CniError(ERR_INVALID_NETNS, f"netns {netns} is the plugin's own network namespace")


def parse_config(stdin: bytes) -> Mapping[str, Any]:
    """The network config: a JSON object (code 6 otherwise) with a valid network ``name`` (code 7)."""
    import json

    try:
        config = json.loads(stdin)
    except ValueError as err:  # UnicodeDecodeError is a ValueError too
        raise CniError(ERR_DECODING, f"error unmarshall network config: {err}") from None
    except RecursionError:  # nesting deeper than the decoder can follow: not a config either
        raise CniError(ERR_DECODING, "error unmarshall network config: nested too deeply") from None
    if not isinstance(config, dict):
        raise CniError(
            ERR_DECODING,
            f"error unmarshall network config: expected a JSON object, got {type(config).__name__}",
        )
    name = config.get("name")
    if not isinstance(name, str) or name == "":
        raise CniError(ERR_INVALID_CONFIG, "missing network name")
    if not _valid_name(name):
        raise CniError(ERR_INVALID_CONFIG, "invalid characters found in network name", name)
    return config


def config_version(config: Mapping[str, Any]) -> str:
    """The config's ``cniVersion``, which this plugin must support (code 1 otherwise)."""
    version = config.get("cniVersion", "")
    if version == "" or version is None:
        version = DEFAULT_CONFIG_VERSION
    if not isinstance(version, str):
        raise CniError(
            ERR_DECODING, f"error unmarshall network config: cniVersion must be a string, got {version!r}"
        )
    if version not in SUPPORTED_VERSIONS:
        raise CniError(
            ERR_INCOMPATIBLE_VERSION,
            "incompatible CNI versions",
            f'config is "{version}", plugin supports {list(SUPPORTED_VERSIONS)}',
        )
    return version


def _check_command_version(args: CmdArgs) -> None:
    """CHECK came with spec 0.4.0, GC and STATUS with 1.1.0: older configs cannot ask for them."""
    needed = {"CHECK": "0.4.0", "GC": "1.1.0", "STATUS": "1.1.0"}.get(args.command)
    if needed is not None and _version_tuple(args.cni_version) < _version_tuple(needed):
        raise CniError(
            ERR_INCOMPATIBLE_VERSION,
            f"config version does not allow {args.command}",
            f'config is "{args.cni_version}", {args.command} needs {needed} or later',
        )


def internal_error_text(msg: str) -> str:
    """A code-999 error result as printed on stdout."""
    return go_json(CniError(ERR_INTERNAL, msg).result())


def main(
    handlers: Mapping[str, Handler],
    *,
    about: str,
    environ: Mapping[str, str] | None = None,
    stdin: BinaryIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run one CNI command; returns the exit status (0, or 1 with an error result on stdout).

    An unexpected exception (a bug) is an error result too, code 999 with its message; its traceback
    goes to ``stderr``. ``handlers`` maps ADD/CHECK/DEL to their handler (GC and STATUS succeed without one, as in Istio).
    Without CNI_COMMAND the plugin says what it is on stderr and exits 0, as the library does.
    """
    import sys

    environ = os.environ if environ is None else environ
    out = stdout or sys.stdout
    if "CNI_COMMAND" not in environ:
        err = stderr or sys.stderr
        err.write(f"{about}\nCNI protocol versions supported: {', '.join(SUPPORTED_VERSIONS)}\n")
        return 0
    try:
        data = b"" if environ.get("CNI_COMMAND") == "VERSION" else (stdin or sys.stdin.buffer).read()
        args = read_args(environ, data)
        if args.command == "VERSION":
            # the library writes this one with json.Encoder: compact, newline-terminated
            versions = ",".join(f'"{v}"' for v in SUPPORTED_VERSIONS)
            out.write(f'{{"cniVersion":"{CURRENT_VERSION}","supportedVersions":[{versions}]}}\n')
            return 0
        _check_command_version(args)
        handler = handlers.get(args.command)
        result = handler(args) if handler is not None else None
        text = go_json(result) if result is not None else ""
    except CniError as err:
        text = go_json(err.result())
        status = 1
    # The plugin's outermost boundary, hence the one broad except: the runtime reads errors as an
    # error result on stdout, so a bug (any exception a handler did not mean) must become one too,
    # rather than a traceback and an empty stdout the runtime cannot tell from a crash.
    except Exception as err:
        import traceback

        traceback.print_exception(err, file=stderr or sys.stderr)
        text = internal_error_text(str(err) or type(err).__name__)
        status = 1
    else:
        status = 0
    out.write(text)
    out.flush()
    return status
