"""``pilot-agent``: Istio's workload agent command line (flags, env and exit codes as Istio's)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import urlsplit

from istio_agent import __version__, goformat
from istio_agent.agent import Agent, AgentSettings
from istio_agent.cli import runtime
from istio_agent.cli.flags import Flag, FlagError, FlagSet, Parsed
from istio_agent.cli.runtime import install_signal_handlers
from istio_agent.config import ConfigError, Env, ProxyConfig, SecuritySettings, XdsSettings
from istio_agent.config.bootstrap import BootstrapSettings, read_pod_annotations
from istio_agent.config.dns import DnsSettings
from istio_agent.config.env import MAX_DURATION, out_of_range, parse_go_int
from istio_agent.config.grpc import GrpcBootstrapSettings, grpc_bootstrap_path
from istio_agent.config.probes import parse_readiness_probe
from istio_agent.config.status import StatusSettings
from istio_agent.envoy.process import EnvoyStartError
from istio_agent.host import LocalHost
from istio_agent.log import DEFAULT_OUTPUT_LEVELS, configure, scope
from istio_agent.memory import pin_mmap_threshold
from istio_agent.metrics import REGISTRY

if TYPE_CHECKING:
    from istio_agent.http.client import Client

log = scope("default")
PROXY_TYPES = ("sidecar", "router", "waypoint", "ztunnel", "agentgateway")
EXIT_ERROR = 255  # Istio exits with os.Exit(-1) on any command error
STOP_GRACE_SECONDS = 10.0
"""Stopping besides Envoy's drain: the drain request (5 s at most), the status server's requests in
flight (2 s), closing streams, saving the DNS table. Defaults give 15 s, within kubelet's 30 s."""
LINGER_SECONDS = 1.0
"""Once stopped, how long exiting may wait for threads still busy (a key being generated)."""
PROG = "pilot-agent"
ROOT_HELP = "Istio's workload agent (pilot-agent), in Python."
ROOT_FLAGS = (
    Flag(
        "log_output_level", default=DEFAULT_OUTPUT_LEVELS, help="scope:level,... (debug|info|warn|error|none)"
    ),
    Flag("log_as_json", boolean=True, help="JSON log lines"),
    Flag("log_target", repeated=True, default=("stdout",), help=None),
    Flag("log_stacktrace_level", default="default:none", help=None),
    Flag("log_caller", default="", help=None),
    Flag("vklog", default="0", help=None),
)
"""Istio's logging flags: persistent in cobra, so they may come before or after the command."""

PROXY_FLAGS = (
    Flag("meshConfig", default="./etc/istio/config/mesh", help="mesh config file"),
    Flag("domain", default="", help="DNS domain suffix (default <POD_NAMESPACE>.svc.cluster.local)"),
    Flag("serviceCluster", default="istio-proxy", help=None),
    Flag("proxyLogLevel", default="warning", help="Envoy log level (and comp:level,...)"),
    Flag("proxyComponentLogLevel", default="", help=None),
    Flag("concurrency", default="0", help=None),
    # Istio's other proxy flags, accepted so the injection template's command line works unchanged.
    Flag("templateFile", default="", help=None),
    Flag("outlierLogPath", default="", help=None),
    Flag("stsPort", default="0", help=None),
    Flag("tokenManagerPlugin", default="", help=None),
    Flag("profiling", boolean=True, default=True, help=None),
)


def proxy(flags: Parsed) -> None:
    """Run the agent next to Envoy: SDS, the xDS proxy, and Envoy itself on a generated bootstrap."""
    proxy_type = flags.args[0] if flags.args else "sidecar"  # more arguments are ignored, as in Istio
    try:
        concurrency = _parse_count("--concurrency", flags.text("concurrency") or "", None)
        _parse_count("--stsPort", flags.text("stsPort") or "", None)
    except CommandError as err:
        _fail(str(err))
    mesh_config = flags.text("meshConfig") or ""
    domain = flags.text("domain") or ""
    proxy_log_level = flags.text("proxyLogLevel") or ""
    proxy_component_log_level = flags.text("proxyComponentLogLevel") or ""
    outlier_log_path = flags.text("outlierLogPath") or ""
    as_json = bool(flags.boolean("log_as_json"))
    try:
        configure(flags.text("log_output_level") or "", as_json, stream=sys.stdout)
    except ValueError as err:
        _fail(str(err))
    if proxy_type not in PROXY_TYPES:
        _fail(f"invalid proxy Type: {proxy_type}")
    env = Env()
    workdir = Path.cwd()
    log.info("pilot-agent %s starting (%s) in %s", __version__, proxy_type, workdir)
    try:
        proxy_config = ProxyConfig.load(env, workdir / mesh_config, read_pod_annotations(workdir))
        security = SecuritySettings.from_env(env, workdir, proxy_config)
        xds = XdsSettings.from_env(env, security, proxy_config, proxy_type)
        status = StatusSettings.from_env(env, proxy_config, proxy_type)
        health = parse_readiness_probe(proxy_config.readiness_probe)
        dns = DnsSettings.from_env(
            env,
            proxy_type=proxy_type,
            domain=domain,
            is_root=os.geteuid() == 0,
            proxy_metadata=proxy_config.proxy_metadata,
        )
        disable_envoy = env.flag("DISABLE_ENVOY")
        # Envoy's node is also the proxyless gRPC bootstrap's, so it is resolved with or without Envoy.
        node = BootstrapSettings.from_env(
            env,
            workdir=workdir,
            proxy_config=proxy_config,
            host=LocalHost(),
            security=security,
            proxy_type=proxy_type,
            domain=domain,
            log_level=proxy_log_level,
            component_log_level=proxy_component_log_level,
            concurrency=concurrency,
            log_as_json=as_json,
            outlier_log_path=outlier_log_path,
        )
        bootstrap = None if disable_envoy else node
        grpc_path = grpc_bootstrap_path(env, workdir)
        grpc_bootstrap = (
            GrpcBootstrapSettings.from_settings(grpc_path, node, xds, security) if grpc_path else None
        )
    except ConfigError as err:
        _fail(str(err))
    settings = AgentSettings(
        security=security,
        proxy_config=proxy_config,
        xds=xds,
        bootstrap=bootstrap,
        status=status,
        health=health,
        serve_sds=not disable_envoy,
        grpc_bootstrap=grpc_bootstrap,
        dns=dns,
        workdir=workdir,
    )
    pin_mmap_threshold()  # large xDS pushes must not ratchet resident memory up (see memory.py)
    try:
        code = runtime.run(_run_agent(settings))
    except (ConfigError, OSError) as err:  # bad settings, a socket or port that cannot be bound, no Envoy
        _fail(str(err))
    sys.exit(code)


async def _run_agent(settings: AgentSettings) -> int:
    """Run until SIGINT/SIGTERM, ``/quitquitquit`` or Envoy exiting for good; return the exit status.

    Signals and ``/quitquitquit`` exit 0, as does Envoy exiting with status 0. Beyond Istio (which
    always exits 0 here): Envoy exiting with an error or killed by a signal, with no restart to
    follow, exits 1, so a supervisor (systemd, a VM's init) sees the failure. An Envoy that cannot
    be executed at all raises OSError (the caller exits 255 naming the binary).
    """
    exit_deadline = runtime.ExitDeadline(log)
    stop_within = stop_deadline(settings)
    signalled = install_signal_handlers(
        lambda: exit_deadline.arm(
            stop_within, 0, f"the agent did not stop within {stop_within:g}s of SIGTERM"
        )
    )
    agent = Agent(settings, registry=REGISTRY)
    code = 0
    try:
        await agent.start()
        envoy_exit = asyncio.ensure_future(agent.wait_envoy())
        waiters = [
            asyncio.ensure_future(signalled.wait()),
            envoy_exit,
            asyncio.ensure_future(agent.stop_requested.wait()),  # /quitquitquit
        ]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if envoy_exit.done() and not envoy_exit.cancelled() and envoy_exit.exception() is None:
                status = envoy_exit.result()
                if status != 0:
                    log.error(
                        "Envoy did not exit cleanly (%s): the agent exits with status 1",
                        goformat.exit_text(status),
                    )
                    code = 1
        finally:
            for task in waiters:
                task.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
    except EnvoyStartError as err:
        code = EXIT_ERROR
        raise OSError(f"cannot start Envoy: {err}") from None
    except (ConfigError, OSError):
        code = EXIT_ERROR  # the caller reports it and exits 255
        raise
    except BaseException:
        code = 1  # a bug: Python prints the traceback and exits 1
        raise
    finally:
        exit_deadline.arm(stop_within, code, f"the agent did not stop within {stop_within:g}s")
        await agent.stop()
        exit_deadline.arm(
            LINGER_SECONDS,
            code,
            "the agent stopped; exiting without waiting for work still running in other threads",
            logging.INFO,
        )
    return code


def stop_deadline(settings: AgentSettings) -> float:
    """Seconds the agent may take to stop: Envoy's drain (terminationDrainDuration, or drainDuration
    with EXIT_ON_ZERO_ACTIVE_CONNECTIONS) plus what the other steps need."""
    drain = settings.bootstrap.drain_budget.total_seconds() if settings.bootstrap is not None else 0.0
    return drain + STOP_GRACE_SECONDS


VERSION_FLAGS = (
    Flag("short", "s", boolean=True, default=False, help="print only the version"),
    Flag("output", "o", default="", help="one of 'yaml' or 'json'"),
)


def version(flags: Parsed) -> None:
    """Print the version."""
    output = flags.text("output")
    if output not in ("", "yaml", "json"):
        _fail("--output must be 'yaml' or 'json'")  # Istio's message (pkg/version/cobra.go)
    python = sys.version.split()[0]
    if flags.boolean("short"):
        print(__version__)
    elif output == "json":
        print(f'{{"clientVersion": {{"version": "{__version__}", "golang_version": "python{python}"}}}}')
    elif output == "yaml":
        print(f"clientVersion:\n  version: {__version__}\n  golang_version: python{python}")
    else:
        print(f'version.BuildInfo{{Version:"{__version__}", PythonVersion:"{python}"}}')


# --- `wait` and `request` (docs/status.md; Istio: pilot/cmd/pilot-agent/app/wait.go, request.go) -------

DEFAULT_READY_URL = "http://localhost:15021/healthz/ready"
ALLOWED_DEBUG_PORTS = (15000, 15004, 15020, 15021)
REQUEST_TIMEOUT_SECONDS = 60.0
MAX_SECONDS = int(MAX_DURATION.total_seconds())
"""Go's time.Duration range, in the units of the flags: no longer wait is possible in Istio's agent."""
MAX_MILLISECONDS = MAX_SECONDS * 1000


class CommandError(Exception):
    """A `wait`/`request` failure: its message is printed as ``Error: <message>`` and the exit status is 255."""


def _parse_count(name: str, raw: str, minimum: int | None, maximum: int | None = None) -> int:
    """An integer flag or env value as Go's flag parser accepts it, within ``minimum..maximum``."""
    try:
        value = parse_go_int(raw)
    except ValueError:
        raise CommandError(f"invalid value {raw!r} for {name}: not an integer") from None
    problem = out_of_range(value, minimum, maximum)
    if problem is not None:
        raise CommandError(f"invalid value {raw!r} for {name}: {problem}")
    return value


def _go_op(method: str) -> str:
    """Go's net/http names the failed operation like ``Get`` / ``Post`` in its errors."""
    return method[:1].upper() + method[1:].lower()


def _describe(err: BaseException, timeout: float) -> str:
    """A one-line reason for a failed HTTP exchange (never a traceback)."""
    if isinstance(err, TimeoutError):
        return f"request timed out after {timeout:g}s (Client.Timeout exceeded)"
    text = str(err)
    return text if text else type(err).__name__


async def check_ready(client: Client, url: str, timeout: float) -> str | None:
    """GET ``url`` and read the whole body; None when the status is 200, else why not."""
    from istio_agent.http.client import HTTPError

    try:
        async with asyncio.timeout(timeout):
            answer = await client.fetch("GET", url)
    except (TimeoutError, HTTPError) as err:
        return f'Get "{url}": {_describe(err, timeout)}'
    return None if answer.status == 200 else f"HTTP status code {answer.status}"


async def wait_until_ready(url: str, *, timeout: float, period: float, request_timeout: float) -> None:
    """Poll ``url`` every ``period`` seconds (first poll after one period) until it answers 200.

    Raises CommandError with Istio's message (and the last failure) once ``timeout`` seconds have passed.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last_error = "<nil>"  # what Go prints when no attempt was made before the deadline
    from istio_agent.http.client import Client  # `proxy` does not need it before Envoy starts

    client = Client(keepalive=True)  # as Go's default client: one connection, reused
    try:
        while True:
            if loop.time() + period > deadline:
                await asyncio.sleep(max(0.0, deadline - loop.time()))
                raise CommandError(
                    f"timeout waiting for Envoy proxy to become ready. Last error: {last_error}"
                )
            await asyncio.sleep(period)
            error = await check_ready(client, url, request_timeout)
            if error is None:
                return
            last_error = error
            log.debug("Not ready yet: %s", error)
    finally:
        await client.aclose()


WAIT_FLAGS = (
    Flag("timeoutSeconds", help="maximum seconds to wait (60)"),
    Flag("requestTimeoutMillis", default="500", help="timeout of each readiness request"),
    Flag("periodMillis", default="500", help="pause before each readiness request"),
    Flag("url", default=DEFAULT_READY_URL, help="readiness URL"),
)


def wait(flags: Parsed) -> None:
    """Waits until the Envoy proxy is ready.

    Without --timeoutSeconds the env WAIT_TIMEOUT_SECONDS (beyond Istio) sets the overall timeout.
    """
    try:
        configure(flags.text("log_output_level") or "", bool(flags.boolean("log_as_json")), stream=sys.stdout)
    except ValueError as err:
        _fail(str(err))
    timeout_seconds = flags.text("timeoutSeconds")
    request_timeout_millis = flags.text("requestTimeoutMillis") or ""
    period_millis = flags.text("periodMillis") or ""
    url = flags.text("url") or ""
    try:
        if timeout_seconds is None:
            env_value = Env().text("WAIT_TIMEOUT_SECONDS")
            timeout = (
                _parse_count("WAIT_TIMEOUT_SECONDS", env_value, 0, MAX_SECONDS) if env_value.strip() else 60
            )
        else:
            timeout = _parse_count("--timeoutSeconds", timeout_seconds, 0, MAX_SECONDS)
        request_timeout = _parse_count("--requestTimeoutMillis", request_timeout_millis, 1, MAX_MILLISECONDS)
        period = _parse_count("--periodMillis", period_millis, 1, MAX_MILLISECONDS)
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise CommandError(f"invalid --url {url!r}: expected http(s)://host[:port]/path")
        _ = parts.port  # raises ValueError for a malformed port
    except ValueError as err:  # CommandError is not a ValueError; this is urlsplit's port check
        _fail(f"invalid --url {url!r}: {err}")
    except CommandError as err:
        _fail(str(err))
    log.info("Waiting for Envoy proxy to be ready (timeout: %d seconds)...", timeout)
    try:
        runtime.run(
            wait_until_ready(
                url, timeout=timeout, period=period / 1000, request_timeout=request_timeout / 1000
            )
        )
    except CommandError as err:
        _fail(str(err))
    log.info("Envoy is ready!")


async def admin_request(
    method: str,
    path: str,
    body: str = "",
    *,
    port: int,
    host: str = "localhost",
    timeout: float = REQUEST_TIMEOUT_SECONDS,
) -> bytes:
    """Send ``<METHOD> http://<host>:<port>/<path>`` and return the response body.

    Raises CommandError for transport failures and for statuses above 399 other than 404 (as Istio's).
    """
    from istio_agent.http.client import HTTPError, fetch

    url = f"http://{host}:{port}/{path.removeprefix('/')}"
    try:
        answer = await fetch(method, url, body=body.encode(), timeout=timeout, max_body=None)
    except (TimeoutError, HTTPError) as err:
        raise CommandError(f'{_go_op(method)} "{url}": {_describe(err, timeout)}') from None
    if answer.status > 399 and answer.status != 404:
        raise CommandError(f"received unsuccessful status code {answer.status}: {answer.text()}")
    return answer.body


REQUEST_FLAGS = (Flag("debug-port", default="15000", help="admin port: 15000, 15004, 15020 or 15021"),)


def request(flags: Parsed) -> None:
    """Makes an HTTP request to the Envoy admin API: request <method> <path> [<body>].

    Only the response body reaches stdout (istioctl parses it); logging stays unconfigured.
    """
    args = flags.args
    try:
        port = _parse_count("--debug-port", flags.text("debug-port") or "", None)
    except CommandError as err:
        _fail(str(err))
    if port not in ALLOWED_DEBUG_PORTS:
        _fail(f"debug port {port} is not in allowed list [{' '.join(map(str, ALLOWED_DEBUG_PORTS))}]")
    if len(args) < 2:
        _fail(f"requires at least 2 arg(s), only received {len(args)}")
    body = args[2] if len(args) > 2 else ""
    try:
        runtime.run(_request_and_print(args[0], args[1], body, port))
    except CommandError as err:
        _fail(str(err))


async def _request_and_print(method: str, path: str, body: str, port: int) -> None:
    """Print the body and a newline, and nothing else: istioctl parses this output as JSON."""
    content = await admin_request(method, path, body, port=port)
    sys.stdout.buffer.write(content + b"\n")
    sys.stdout.buffer.flush()


def iptables_flags() -> tuple[Flag, ...]:
    """istio-iptables' flags, from the one table of them (imported only for this command)."""
    from istio_agent.cni.capture_config import FLAGS

    return tuple(
        Flag(flag.name, flag.short, boolean=True, help=flag.help)
        if flag.boolean
        else Flag(flag.name, flag.short, help=f"{flag.help} ({flag.default or 'none'})")
        for flag in FLAGS
    )


def istio_iptables(flags: Parsed) -> None:
    """Sets up the sidecar's traffic capture (Istio's istio-iptables); --dry-run prints the rules.

    Applies them in the current network namespace (or --network-namespace), --cleanup-only removes
    them, --run-validation checks that traffic is captured (exit 126 if not).
    """
    from istio_agent.cni import command
    from istio_agent.cni.apply import ApplyError
    from istio_agent.cni.capture_config import FLAGS, read_capture_config, read_run_mode

    given: dict[str, str | None] = {}
    for flag in FLAGS:
        if flag.boolean:
            value = flags.boolean(flag.name)
            given[flag.name] = None if value is None else str(value).lower()  # a flag beats its env var
        else:
            given[flag.name] = flags.text(flag.name)
    env = Env()
    try:
        config = read_capture_config(given, env)
        mode = read_run_mode(given, env)
        if config.redirect_dns and not config.capture_all_dns:
            config = dataclasses.replace(config, dns_servers=_resolv_conf_servers())
        if mode.skip_rule_apply and not mode.run_validation:
            return
        if mode.dry_run:
            sys.stdout.write(command.dry_run(config, mode))
            sys.stdout.flush()
            return
        configure(flags.text("log_output_level") or "", bool(flags.boolean("log_as_json")), stream=sys.stdout)
    except ValueError as err:  # ConfigError, or a bad --log_output_level
        _fail(str(err))
    try:
        status = command.run(config, mode, os.environ)
    except (ConfigError, ApplyError) as err:
        _fail(str(err))
    sys.exit(status)


def _resolv_conf_servers() -> tuple[str, ...]:
    """The pod's DNS servers, as istio-init captures them when not capturing all DNS."""
    from istio_agent.cni.capture_config import usable_dns_servers
    from istio_agent.dns.resolvconf import read_resolv_conf

    servers = read_resolv_conf(Path("/etc/resolv.conf")).nameservers
    return usable_dns_servers(host for host, _port in servers)


def _fail(message: str) -> NoReturn:
    """Istio's command error: one line on stderr and exit status 255."""
    print(f"Error: {message}", file=sys.stderr)
    sys.exit(EXIT_ERROR)


# --- the command line (cobra's, read with argparse: click costs the agent 1.7 MB, issue 23) --------------


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its flags (built when it runs), what it does, and how cobra reads its arguments."""

    name: str
    run: Callable[[Parsed], None]
    flags: Callable[[], Sequence[Flag]]
    usage: str = "[flags]"
    tolerant: bool = False
    """Unknown flags are skipped (Istio's root and proxy whitelist them: FParseErrWhitelist)."""
    takes_args: bool = False

    @property
    def help(self) -> str:
        return (self.run.__doc__ or "").strip()


COMMANDS = {
    command.name: command
    for command in (
        Command("istio-iptables", istio_iptables, iptables_flags),
        Command("proxy", proxy, lambda: PROXY_FLAGS, "[sidecar|router|...] [flags]", True, True),
        Command(
            "request", request, lambda: REQUEST_FLAGS, "<method> <path> [<body>] [flags]", takes_args=True
        ),
        Command("version", version, lambda: VERSION_FLAGS),
        Command("wait", wait, lambda: WAIT_FLAGS),
    )
}
_ROOT_VALUE_FLAGS = {f"--{flag.name}" for flag in ROOT_FLAGS if not flag.boolean}


def _flag_set(command: Command) -> FlagSet:
    hidden_root = tuple(dataclasses.replace(flag, help=None) for flag in ROOT_FLAGS)
    return FlagSet(f"{PROG} {command.name}", command.help, (*command.flags(), *hidden_root), command.usage)


def _root_help() -> str:
    listed = "\n".join(
        f"  {name:<16}{command.help.splitlines()[0]}" for name, command in sorted(COMMANDS.items())
    )
    text = FlagSet(PROG, ROOT_HELP, ROOT_FLAGS, "[command]").help()
    return (
        f"{text}\nAvailable Commands:\n{listed}\n"
        f"  {'help':<16}Help about any command\n\n"
        f'Use "{PROG} [command] --help" for more information about a command.\n'
    )


def _split_command(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """The command's name (the first argument that is neither a flag nor a root flag's value) and the
    rest: flags before the name are the command's too, as cobra parses them."""
    rest = list(argv)
    at = 0
    while at < len(rest):
        arg = rest[at]
        if arg == "--":
            break
        if not arg.startswith("-") or arg == "-":
            return arg, rest[:at] + rest[at + 1 :]
        at += 2 if arg in _ROOT_VALUE_FLAGS else 1
    return None, rest


def main(argv: Sequence[str] | None = None) -> None:
    """``pilot-agent [command] [flags]``: run the command (``sys.argv`` when ``argv`` is None)."""
    runtime.prepare_process()
    name, rest = _split_command(sys.argv[1:] if argv is None else argv)
    if name == "help":
        name, rest = (rest[0], ["--help"]) if rest and rest[0] in COMMANDS else (None, [])
    if name is None:
        sys.stdout.write(_root_help())
        return
    command = COMMANDS.get(name)
    if command is None:
        _fail(f'unknown command "{name}" for "{PROG}"')
    flag_set = _flag_set(command)
    try:
        flags = flag_set.parse(rest, tolerant=command.tolerant)
    except FlagError as err:
        _fail(str(err))
    if flags.help:
        sys.stdout.write(flag_set.help())
        return
    if flags.args and not command.takes_args:
        plural = "s" if len(flags.args) > 1 else ""
        _fail(f"Got unexpected extra argument{plural} ({' '.join(flags.args)})")
    command.run(flags)


if __name__ == "__main__":
    main()
