"""``agentctl``: developer commands around the agent (local control plane, tokens, the demo)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import click

from istio_agent.cli import proxy_config_admin, proxy_config_dump, runtime
from istio_agent.cli.aliases import AliasedGroup
from istio_agent.config.env import parse_go_duration
from istio_agent.controlplane import DEFAULT_ADDRESS, DEFAULT_SECURE_ADDRESS
from istio_agent.controlplane.ca import StateError
from istio_agent.controlplane.debug import DebugAccess
from istio_agent.controlplane.mesh import MeshError
from istio_agent.controlplane.tokens import DEFAULT_AUDIENCE, mint_token
from istio_agent.log import DEFAULT_OUTPUT_LEVELS, configure, scope
from istio_agent.metrics import REGISTRY

if TYPE_CHECKING:
    from istio_agent.controlplane.server import ControlPlane

log = scope("controlplane")
STOP_GRACE_SECONDS = 1.0


@click.group(cls=AliasedGroup)
def main() -> None:
    """Developer tools for istio-agent: a local control plane and its tokens."""
    runtime.prepare_process()  # first: the commands import what does the work


@main.command()
@click.option("--mesh", "mesh_path", required=True, type=click.Path(path_type=Path), help="mesh file (YAML)")
@click.option(
    "--state-dir", required=True, type=click.Path(path_type=Path), help="CA root, signing keys (made once)"
)
@click.option("--address", default=DEFAULT_ADDRESS, show_default=True, help="plaintext gRPC HOST:PORT")
@click.option(
    "--secure-address", default=DEFAULT_SECURE_ADDRESS, show_default=True, help="TLS gRPC HOST:PORT"
)
@click.option(
    "--log_output_level", default=DEFAULT_OUTPUT_LEVELS, help="scope:level,... (debug|info|warn|error|none)"
)
@click.option("--log_as_json", is_flag=True, help="JSON log lines")
def controlplane(
    mesh_path: Path,
    state_dir: Path,
    address: str,
    secure_address: str,
    log_output_level: str,
    log_as_json: bool,
) -> None:
    """Run the local control plane (Istio CA service) until SIGINT/SIGTERM.

    As istiod, it reads ENABLE_DEBUG_ENDPOINT_AUTH (default true: syncz and config_dump need an
    authenticated caller, so not the plaintext port) and DEBUG_ENDPOINT_AUTH_ALLOWED_NAMESPACES
    (namespaces besides istio-system whose callers see every proxy) from the environment."""
    try:
        configure(log_output_level, as_json=log_as_json)
    except ValueError as err:
        raise click.ClickException(f"--log_output_level: {err}") from None
    from istio_agent.controlplane.server import ControlPlane, ControlPlaneError

    try:
        debug_access = DebugAccess.from_env(os.environ)
    except ValueError as err:
        raise click.ClickException(str(err)) from None
    plane = ControlPlane(
        mesh_path, state_dir, address, secure_address, debug_access=debug_access, registry=REGISTRY
    )
    try:
        runtime.run(_serve(plane, address, secure_address))
    except (ControlPlaneError, MeshError, StateError) as err:
        raise click.ClickException(str(err)) from None


async def _serve(plane: ControlPlane, address: str, secure_address: str) -> None:
    from istio_agent.controlplane.server import format_address, parse_address

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await plane.start()
        try:
            click.echo(f"control plane: CA root {plane.root_cert_path}")
            click.echo(f"serving plaintext on {format_address(parse_address(address)[0], plane.port)}")
            click.echo(
                f"serving TLS on {format_address(parse_address(secure_address)[0], plane.secure_port)}"
            )
            await stop.wait()
            log.info("received termination signal, shutting down")
        finally:
            await plane.stop(STOP_GRACE_SECONDS)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def _duration(_ctx: click.Context, _param: click.Parameter, value: str) -> timedelta:
    try:
        ttl = parse_go_duration(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    if ttl <= timedelta(0):
        raise click.BadParameter(f"must be positive, got {value!r}")
    return ttl


@main.command()
@click.option(
    "--state-dir", required=True, type=click.Path(path_type=Path), help="the control plane's state dir"
)
@click.option("--namespace", required=True, help="Kubernetes namespace of the identity")
@click.option("--service-account", required=True, help="service account of the identity")
@click.option(
    "--ttl", default="24h", show_default=True, callback=_duration, help="token lifetime (Go duration)"
)
@click.option("--audience", default=DEFAULT_AUDIENCE, show_default=True, help="token audience")
def token(state_dir: Path, namespace: str, service_account: str, ttl: timedelta, audience: str) -> None:
    """Print a token the local control plane accepts for NAMESPACE/SERVICE-ACCOUNT."""
    try:
        click.echo(mint_token(state_dir, namespace, service_account, ttl=ttl, audience=audience))
    except (ValueError, StateError) as err:
        raise click.ClickException(str(err)) from None


@main.command()
@click.option("--keep", is_flag=True, help="leave everything running and print how to stop it")
@click.option(
    "--wasm",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="a proxy-wasm module to run as a WasmPlugin (served over HTTP, fetched by the agents)",
)
def demo(keep: bool, wasm: Path | None) -> None:
    """Two workloads on loopback (app + pilot-agent + Envoy each) meshed by the local control plane."""
    from istio_agent.ctl.demo import demo as run_demo

    try:
        code = run_demo(keep, click.echo, wasm)
    except (RuntimeError, TimeoutError, OSError) as err:
        raise click.ClickException(f"demo failed: {err}") from None
    raise SystemExit(code)


@main.group("proxy-config", cls=AliasedGroup)
def proxy_config() -> None:
    """Show what an Envoy holds (as istioctl proxy-config)."""


assert isinstance(proxy_config, AliasedGroup) and isinstance(main, AliasedGroup)
proxy_config_dump.register(proxy_config)
proxy_config_admin.register(proxy_config)
proxy_config.add_aliases("secret", "secrets", "s")
main.add_aliases("proxy-config", "pc")
main.add_aliases("proxy-status", "ps")


@proxy_config.command("secret")
@click.argument("target", required=False)
@click.option("-f", "--file", "dump_file", help="an Envoy config_dump file instead of an admin address")
@click.option(
    "-o",
    "--output",
    type=click.Choice(["short", "json", "yaml", "items"]),
    default="short",
    show_default=True,
    help="short: the table; json|yaml: the SecretsConfigDump (as istioctl); items: the items as JSON",
)
@click.option("-v", "--verbose", is_flag=True, help="add EXPIRES (relative to now) and CHAIN columns")
@click.option("--diff", is_flag=True, help="compare with what the agent holds and the cert files on disk")
@click.option(
    "--agent",
    "agent_address",
    default="127.0.0.1:15020",
    show_default=True,
    help="the agent's status address for --diff (its /debug/secrets answers loopback only)",
)
@click.option(
    "--timeout", default=5.0, show_default=True, type=click.FloatRange(min=0.1), help="seconds per request"
)
def proxy_config_secret(
    target: str | None,
    dump_file: str | None,
    output: str,
    verbose: bool,
    diff: bool,
    agent_address: str,
    timeout: float,
) -> None:
    """Envoy's secrets from TARGET (its admin HOST:PORT, default 127.0.0.1:15000, or a config_dump file).

    VALID CERT is istioctl's: false for an expired or not-yet-valid certificate. -v adds CHAIN:
    whether a chain leads to the trust bundle Envoy holds for it (ROOTCA for the workload's,
    X-cacert for a gateway's X); why anything is wrong goes to stderr. See docs/proxy-config-secret.md.
    """
    from istio_agent.ctl.proxyconfig import SecretQuery, resolve_target, run
    from istio_agent.ctl.secrets import SecretsError

    try:
        address, path = resolve_target(target, dump_file)
        query = SecretQuery(address, path, output, verbose, diff, agent_address, timeout)
        runtime.run(run(query, click.echo, lambda line: click.echo(line, err=True)))
    except SecretsError as err:
        raise click.ClickException(str(err)) from None


@main.group("cni")
def cni() -> None:
    """Check a pod's traffic capture (the istio-cni side)."""


@cni.command("check")
@click.argument("target")
@click.option(
    "--pod",
    "pod_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="the pod object (kubectl get pod -o json|yaml) whose annotations decide the expected rules",
)
@click.option("--pod-name", help="NAMESPACE/NAME: fetch the pod from the API server of --kubeconfig")
@click.option(
    "--kubeconfig",
    type=click.Path(path_type=Path, dir_okay=False),
    default="/var/run/istio-cni/istio-cni-kubeconfig",
    show_default=True,
    help="for --pod-name (default: the one install-cni writes for the plugin)",
)
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True)
def cni_check(
    target: str, pod_file: Path | None, pod_name: str | None, kubeconfig: Path, output: str
) -> None:
    """Compare the capture rules in a pod's network namespace with the ones Istio expects for it.

    TARGET is the namespace (a path such as /var/run/netns/cni-...) or the pid of any process in
    the pod. The expected rules come from the pod (--pod or --pod-name) as the istio-cni plugin
    decides them; without either, from the defaults of an injected pod without annotations.
    Exit status: 0 when they match, 1 when rules are missing, left over or out of order, 2 on errors.
    See docs/cni.md.
    """
    from istio_agent.cni.check import CheckError
    from istio_agent.ctl.cnicheck import fetch_pod, load_pod, run

    try:
        if pod_file is not None and pod_name is not None:
            raise CheckError("give either --pod or --pod-name, not both")
        pod = load_pod(pod_file) if pod_file else fetch_pod(kubeconfig, pod_name) if pod_name else None
        matches = run(target, pod, output, click.echo, os.environ)
    except CheckError as err:
        click.echo(f"Error: {err}", err=True)
        sys.exit(2)
    sys.exit(0 if matches else 1)


@main.command("proxy-status")
@click.argument("proxy", required=False)
@click.option("--xds-address", help="ask this control plane directly (HOST:PORT)")
@click.option("--plaintext", is_flag=True, help="with --xds-address: no TLS")
@click.option("--root-cert", type=click.Path(path_type=Path), help="TLS: root to verify the control plane")
@click.option("--server-name", default="", help="TLS: server name to verify (default: the address's host)")
@click.option("--token", "token_path", type=click.Path(path_type=Path), help="TLS: bearer token file")
@click.option("--xds-via-agents", is_flag=True, help="ask agents' debug taps (port 15004) instead")
@click.option(
    "--agent-address", "agent_addresses", multiple=True, help="an agent: HOST:PORT or NAME=HOST:PORT"
)
@click.option("--agent-addresses-file", type=click.Path(path_type=Path), help="agents, one a line")
@click.option("--xds-via-agents-limit", default=100, show_default=True, type=click.IntRange(min=0))
@click.option(
    "--timeout", default="10s", show_default=True, callback=_duration, help="per control plane/agent"
)
@click.option("--concurrency", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("-n", "--namespace", help="only proxies in this namespace")
@click.option(
    "-i", "--istio-namespace", default="istio-system", show_default=True, help="the asker's namespace"
)
@click.option(
    "-v",
    "--verbosity",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    is_flag=False,
    flag_value=1,
    help="as istioctl: 0 the summary, 1 one column per type (with ages); NACK texts go to stderr",
)
@click.option(
    "-o",
    "--output",
    default="table",
    show_default=True,
    type=click.Choice(["table", "json", "yaml"]),
    help="json|yaml: each control plane's syncz DiscoveryResponse, as istioctl prints it",
)
@click.option(
    "--proxy-admin-address",
    default="127.0.0.1:15000",
    show_default=True,
    help="with PROXY: its Envoy's admin (HOST:PORT; istioctl port-forwards to --proxy-admin-port)",
)
@click.option("--file", "config_dump_file", help="with PROXY: a saved Envoy config dump instead (- is stdin)")
def proxy_status(
    proxy: str | None,
    xds_address: str | None,
    plaintext: bool,
    root_cert: Path | None,
    server_name: str,
    token_path: Path | None,
    xds_via_agents: bool,
    agent_addresses: tuple[str, ...],
    agent_addresses_file: Path | None,
    xds_via_agents_limit: int,
    timeout: timedelta,
    concurrency: int,
    namespace: str | None,
    istio_namespace: str,
    verbosity: int,
    output: str,
    proxy_admin_address: str,
    config_dump_file: str | None,
) -> None:
    """Sync status of proxies (istioctl proxy-status), from a control plane or through agents.

    With PROXY (<pod>[.<namespace>]), as istioctl: the diff of the clusters, listeners and routes the
    control plane would send that proxy against what its Envoy holds (--proxy-admin-address or
    --file); through --xds-via-agents the agent named PROXY is asked. See docs/operator-tools.md.

    Against istiod (or the local control plane) directly, use its TLS port with a token: istiod
    answers debug questions only to authenticated callers (ENABLE_DEBUG_ENDPOINT_AUTH), and those
    outside istio-system only about their own namespace."""
    from istio_agent.ctl import proxydiff
    from istio_agent.ctl import proxystatus as ps

    if xds_via_agents == bool(xds_address):
        raise click.UsageError("give exactly one of --xds-address and --xds-via-agents")
    agents: list[ps.Agent] = []
    try:
        agents = [ps.Agent.parse(text) for text in agent_addresses]
        if agent_addresses_file is not None:
            agents += ps.read_agents(agent_addresses_file)
    except (ValueError, OSError) as err:
        raise click.BadParameter(str(err), param_hint="--agent-address/--agent-addresses-file") from None
    if xds_via_agents and not agents:
        raise click.UsageError("--xds-via-agents needs --agent-address or --agent-addresses-file")
    target = None
    if xds_address:
        target = ps.ControlPlaneTarget(xds_address, plaintext, root_cert, server_name, token_path)
    if proxy:
        diff = proxydiff.DiffOptions(
            proxy=proxy,
            namespace=namespace or "default",
            target=target,
            agents=agents,
            admin_address=proxy_admin_address,
            file=config_dump_file,
            timeout=timeout.total_seconds(),
            identity=(istio_namespace, "default"),
        )
        try:
            report = runtime.run(proxydiff.run(diff))
        except proxydiff.DiffError as err:
            click.echo(err.printed, nl=False)
            raise click.ClickException(str(err)) from None
        except ps.ProxyStatusError as err:
            raise click.ClickException(str(err)) from None
        click.echo(report.stdout, nl=False)
        return
    options = ps.Options(
        target=target,
        agents=agents,
        view=ps.View(namespace=namespace, verbosity=verbosity, output=output),
        limit=xds_via_agents_limit,
        timeout=timeout.total_seconds(),
        concurrency=concurrency,
        identity=(istio_namespace, "default"),
    )
    try:
        report = runtime.run(ps.run(options))
    except ps.ProxyStatusError as err:
        raise click.ClickException(str(err)) from None
    for line in report.stderr:
        click.echo(line, err=True)
    click.echo(report.stdout, nl=False)


if __name__ == "__main__":
    main(prog_name="agentctl")
