"""The istio-cni plugin's ADD: decide from the pod whether it needs sidecar capture, and program it.

The order of the decisions is Istio's (``cni/pkg/plugin/plugin.go``, ``CmdAdd``/``doAddRun``): the
node agent's own pod first (before the kubeconfig is even read: on a reboot the agent that writes it
is that very pod), excluded namespaces, then the pod from the API server, the skip rules and the
pod's capture settings (``redirect.py``), and last the rules inside the pod's network namespace.

In ambient mode (``ambient_enabled``) a pod the enablement selectors make ambient (``cni/ambient/selectors.py``,
from its labels and its namespace's) gets nothing from the plugin itself: its event goes, synchronously,
to the node agent (``POST http://unix/cmdadd`` on ``<cni_agent_run_dir>/pluginevent.sock``, Istio's
``cni/pkg/plugin/cnieventclient.go``), which programs the pod and hands it to ztunnel; a node agent
that cannot be reached, or does not answer 200, fails the ADD. Other pods take the sidecar path.

It fails closed and in bounded time: the whole ADD, API retries and programming included, runs
under one deadline (``add_timeout`` in the config, else :data:`DEFAULT_ADD_TIMEOUT`), and an API
error, an RBAC denial, a timeout or a vanished netns is a CNI error: the pod's sandbox is not
created, rather than created without its rules.

It is written for a short-lived process: no event loop (the pod GET is the HTTP stack's blocking
client), and only what the ADD in hand needs is imported.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from istio_agent.cni import result
from istio_agent.cni.args import ArgsError, K8sArgs, is_agent_pod, parse_k8s_args
from istio_agent.cni.plugin_config import NetworkConfig, parse_network_config
from istio_agent.cni.skel import ERR_INTERNAL, CmdArgs, CniError
from istio_agent.config.env import ConfigError
from istio_agent.logline import Scope

if TYPE_CHECKING:  # pathlib too: a pod that gets no rules needs no Path (~1 ms to import)
    from pathlib import Path

    from istio_agent.cni.capture_config import CaptureConfig

DEFAULT_ADD_TIMEOUT = timedelta(seconds=30)
"""Istio retries the pod GET 30 times a second apart; the same bound here, for everything."""
RETRY_INTERVAL = 1.0
ATTEMPT_TIMEOUT = 5.0
"""One API request may take this long before it is abandoned and tried again (within the deadline)."""
DRY_RUN_ENV = "DRY_RUN_FILE_PATH"
AMBIENT_CHECK_ATTEMPTS = 2
"""Istio asks for the pod and its namespace once more after a failure (constant 1 s back-off)..."""
AMBIENT_CHECK_ATTEMPTS_RETRYING = 31
"""...or 30 times more with ``enable_ambient_detection_retry`` (its ``podRetrievalMaxRetries``)."""
EVENT_SOCKET = "pluginevent.sock"
EVENT_PATH = "/cmdadd"
EVENT_TIMEOUT = 5.0
"""Istio's event client gives up after this long (within the ADD's deadline here)."""
MAX_EVENT_ANSWER = 2**20
"""Of a refusal's body, this much goes into the error (Istio's ``io.LimitReader``)."""
CONTACT_FAILED = "istio-cni cmdAdd failed to contact node Istio CNI agent: "

log = Scope("cni-plugin")


class PluginError(Exception):
    """ADD cannot complete; the message is the CNI error's ``msg``."""


class Programmer(Protocol):
    """Sets up ``config``'s rules inside the network namespace ``netns`` before ``deadline``
    (``time.monotonic()``); raises PluginError saying what failed, leaving nothing half applied
    (the ADD then fails with it as the CNI error's message)."""

    def __call__(self, config: CaptureConfig, netns: Path, deadline: float) -> None: ...


PodGetter = Callable[[str, str, float], dict[str, Any]]
"""Fetches ``(namespace, name)`` before the deadline; raises ``KubeError``."""
NamespaceGetter = Callable[[str, float], dict[str, Any]]
"""Fetches the namespace ``name`` before the deadline; raises ``KubeError``."""
EventPoster = Callable[[str, bytes, float], None]
"""POSTs the event (JSON) on the node agent's socket before the deadline; raises :class:`EventError`."""


class EventError(Exception):
    """The node agent did not take the event: the message is Istio's ``PushCNIEvent`` error."""


class DryRunWriter:
    """Istio's dry run (``DRY_RUN_FILE_PATH``): the rule set goes to a file, nothing is applied.

    ``native_nftables``: write the nftables transaction (``native_nftables`` in the plugin's config)
    instead. The programmers are plain classes, not dataclasses: this module is imported on every
    ADD, and a dataclass costs ~0.5 ms of generated code at import (docs/performance.md).
    """

    __slots__ = ("native_nftables", "path")

    def __init__(self, path: str, native_nftables: bool = False) -> None:
        self.path = path
        self.native_nftables = native_nftables

    def __call__(self, config: CaptureConfig, netns: Path, deadline: float) -> None:
        from pathlib import Path

        from istio_agent.files import write_atomic

        if self.native_nftables:
            from istio_agent.cni.nftables.builder import render_config

            text = render_config(config)
        else:
            from istio_agent.cni.rules import render_families

            v4, v6 = render_families(config)
            text = v4 + (v6 or "")
        try:
            write_atomic(Path(self.path), text)
        except OSError as err:
            raise PluginError(
                f"cannot write the dry-run rules to {self.path}: {err.strerror or err}"
            ) from None


class NetnsApplier:
    """Applies the rules inside the pod's namespace with the node's iptables backend (``cni/apply.py``).

    IPv6 is decided from the pod's own addresses, as Istio's plugin does: the first address that is
    neither loopback nor link-local, or any IPv6 address when the proxy asks for dual stack (the
    redirect carries ``ISTIO_DUAL_STACK`` in ``enable_ipv6``). ``environ`` is the plugin's
    environment (``FORCE_IPTABLES_BINARY``; the repair controller passes install-cni's). With
    ``native_nftables`` (the plugin's config) the rules are Istio's nftables tables instead
    (``cni/nftables``).
    """

    __slots__ = ("environ", "native_nftables")

    def __init__(self, environ: Mapping[str, str] | None = None, native_nftables: bool = False) -> None:
        self.environ = environ
        self.native_nftables = native_nftables

    def __call__(self, config: CaptureConfig, netns: Path, deadline: float) -> None:
        from dataclasses import replace

        from istio_agent.cni.apply import ApplyError
        from istio_agent.cni.netns import CommandError, Deadline, pod_ipv6

        try:
            ipv6 = pod_ipv6(netns, dual_stack=config.enable_ipv6, deadline=Deadline(deadline))
            config = replace(config, enable_ipv6=ipv6)
            if self.native_nftables:
                from istio_agent.cni.nftables.apply import apply_nft_capture

                apply_nft_capture(config, netns=netns, deadline=deadline, env=self.environ, read_back=False)
            else:
                from istio_agent.cni.apply import apply_capture

                apply_capture(config, netns=netns, deadline=deadline, env=self.environ, read_back=False)
        except (ApplyError, CommandError) as err:
            raise PluginError(f"cannot set up the redirect in {netns}: {err}") from None


def select_programmer(environ: Mapping[str, str], *, native_nftables: bool = False) -> Programmer:
    """The dry-run writer when ``DRY_RUN_FILE_PATH`` is set, else the applier; for iptables, or
    nftables with the plugin config's ``native_nftables``."""
    path = environ.get(DRY_RUN_ENV, "")
    if path:
        return DryRunWriter(path, native_nftables)
    return NetnsApplier(environ, native_nftables)


def _configure_logging(level: str) -> None:
    """Istio's JSON lines on stderr, written by :mod:`istio_agent.logline` (not ``logging``: ~6 ms
    of every ADD), for this scope and those of the rule modules a mesh pod's ADD runs."""
    from istio_agent import logline

    try:
        logline.write_lines(level, as_json=True)
    except ValueError:
        logline.write_lines("info", as_json=True)
        log.warning("plugin_log_level %r is not a log level; using info", level)


def fetch_pod(
    get: PodGetter,
    namespace: str,
    name: str,
    deadline: float,
    *,
    retry_interval: float = RETRY_INTERVAL,
) -> dict[str, Any]:
    """The pod, asked again while the failure may pass (an outage, a 5xx, a timeout) and time remains.

    An answer that cannot change by asking again (403, 404, 401) fails at once, naming the status:
    on a node with hundreds of pods starting, retrying a denial only adds load and delay.
    """
    from istio_agent.cni.kube import KubeError

    attempt = 0
    while True:
        attempt += 1
        try:
            return get(namespace, name, min(deadline, time.monotonic() + ATTEMPT_TIMEOUT))
        except KubeError as err:
            if not err.retryable:
                raise PluginError(str(err)) from None
            if deadline - time.monotonic() <= retry_interval:
                raise PluginError(
                    f"{err} (gave up after {attempt} attempt(s): the ADD deadline is reached)"
                ) from None
            log.warning("%s; trying again in %gs (attempt %d)", err, retry_interval, attempt)
        time.sleep(retry_interval)  # the next attempt; this process has nothing else to do meanwhile


def plan(
    k8s: K8sArgs, config: NetworkConfig, get: PodGetter, deadline: float, environ: Mapping[str, str]
) -> CaptureConfig | None:
    """The capture the pod needs, or None when the plugin leaves it alone (logged with the reason).
    ``environ`` is the plugin's environment (the runtime's; install-cni's for the repair controller)."""
    from istio_agent.cni.pod import skip_reason

    pod_id = f"{k8s.pod_namespace}/{k8s.pod_name}"
    pod = fetch_pod(get, k8s.pod_namespace, k8s.pod_name, deadline)
    reason = skip_reason(pod)
    if reason is not None:
        log.info("pod %s: no redirect: %s", pod_id, reason)
        return None
    from istio_agent.cni.redirect import capture_config  # only a pod that needs rules pays for it

    try:
        return capture_config(pod, environ)
    except ConfigError as err:
        raise PluginError(f"pod {pod_id}: {err}") from None


def ambient_check(
    k8s: K8sArgs,
    config: NetworkConfig,
    get_pod: PodGetter,
    get_namespace: NamespaceGetter,
    deadline: float,
    *,
    retry_interval: float = RETRY_INTERVAL,
) -> tuple[bool, dict[str, Any]]:
    """Whether the pod is ambient, and the pod (Istio's ``isAmbientPod``): the pod and its namespace are
    both asked for on each attempt, :data:`AMBIENT_CHECK_ATTEMPTS` of them (more with the retry flag),
    within the deadline; PluginError when they could not be had."""
    from istio_agent.cni.ambient.selectors import SelectorError, compile_selectors, labels_of, pod_is_ambient
    from istio_agent.cni.kube import KubeError

    try:
        selectors = compile_selectors(config.plugin.enablement_selectors, "enablement_selectors")
    except SelectorError as err:
        raise PluginError(f"failed to instantiate ambient enablement selector: {err}") from None
    attempts = (
        AMBIENT_CHECK_ATTEMPTS_RETRYING
        if config.plugin.enable_ambient_detection_retry
        else AMBIENT_CHECK_ATTEMPTS
    )
    pod_error: KubeError | None = None
    namespace_error: KubeError | None = None
    for attempt in range(1, attempts + 1):
        pod_error = namespace_error = None
        attempt_deadline = min(deadline, time.monotonic() + ATTEMPT_TIMEOUT)
        try:
            pod = get_pod(k8s.pod_namespace, k8s.pod_name, attempt_deadline)
        except KubeError as err:
            pod_error = err
        try:
            namespace = get_namespace(k8s.pod_namespace, attempt_deadline)
        except KubeError as err:
            namespace_error = err
        if pod_error is None and namespace_error is None:
            ambient = pod_is_ambient(
                selectors, labels_of(pod), labels_of(pod, "annotations"), labels_of(namespace)
            )
            return ambient, pod
        log.debug("ambient check: podErr=%s, nsErr=%s (attempt %d)", pod_error, namespace_error, attempt)
        if attempt == attempts or deadline - time.monotonic() <= retry_interval:
            break
        time.sleep(retry_interval)
    raise PluginError(
        f"failed to get pod or namespace info: podErr={_go_error(pod_error)}, nsErr={_go_error(namespace_error)}"
    )


def _go_error(err: Exception | None) -> str:
    return "<nil>" if err is None else str(err)


def event_body(args: CmdArgs, previous: Mapping[str, Any] | None, k8s: K8sArgs) -> bytes:
    """Istio's ``CNIPluginAddEvent`` as Go encodes it: the netns, the pod, and the previous result's
    addresses (``net.IPNet``: the address as text, the mask as base64 bytes)."""
    import base64
    import ipaddress
    import json

    ips = []
    for ip in (previous or {}).get("ips", ()):
        interface = ipaddress.ip_interface(ip["address"])
        ips.append(
            {
                "Interface": ip.get("interface"),
                "Address": {
                    "IP": str(interface.ip),
                    "Mask": base64.b64encode(interface.netmask.packed).decode(),
                },
                "Gateway": ip.get("gateway", ""),
            }
        )
    event = {
        "Netns": args.netns,
        "PodName": k8s.pod_name,
        "PodNamespace": k8s.pod_namespace,
        "IPs": ips or None,
    }
    return json.dumps(event, separators=(",", ":")).encode()


def post_event(socket_path: str, body: bytes, deadline: float) -> None:
    """POST the event on the node agent's Unix socket (the blocking client, as the pod GET); EventError
    with the wording of Istio's Go client when it is not taken."""
    from istio_agent.http.blocking import fetch
    from istio_agent.http.exchange import BodyTooLarge, ConnectError, HTTPError

    where = f'Post "http://unix{EVENT_PATH}"'
    try:
        answer = fetch(
            "POST",
            f"http://unix{EVENT_PATH}",
            deadline=min(deadline, time.monotonic() + EVENT_TIMEOUT),
            headers={"Content-Type": "application/json"},
            body=body,
            max_body=MAX_EVENT_ANSWER,
            unix_socket=socket_path,
        )
    except ConnectError as err:
        reason = (err.os_error.strerror or str(err.os_error)).lower()
        raise EventError(
            f"failed to send event request: {where}: dial unix {socket_path}: connect: {reason}"
        ) from None
    except TimeoutError:
        raise EventError(
            f"failed to send event request: {where}: context deadline exceeded "
            "(Client.Timeout exceeded while awaiting headers)"
        ) from None
    except BodyTooLarge:
        raise EventError(f"unable to push CNI event: its answer is over {MAX_EVENT_ANSWER} bytes") from None
    except HTTPError as err:
        raise EventError(f"failed to send event request: {where}: {err}") from None
    if answer.status != 200:
        text = answer.body.decode("utf-8", errors="replace")
        raise EventError(f"unable to push CNI event (status code {answer.status}): {text}")


def _ambient_add(
    args: CmdArgs,
    k8s: K8sArgs,
    config: NetworkConfig,
    previous: Mapping[str, Any] | None,
    deadline: float,
    get_pod: PodGetter,
    get_namespace: NamespaceGetter,
    send: EventPoster,
) -> tuple[bool, dict[str, Any] | None]:
    """Istio's ambient block of ``doAddRun``: (handled, the pod when it was read). Handled: the node
    agent took the pod's event; not handled: the pod is not ambient and goes the sidecar way."""
    pod_id = f"{k8s.pod_namespace}/{k8s.pod_name}"
    try:
        ambient, pod = ambient_check(k8s, config, get_pod, get_namespace, deadline)
    except PluginError as err:
        if config.plugin.enable_ambient_detection_retry:
            raise
        log.error("pod %s: istio-cni cmdAdd failed to check if pod is ambient: %s", pod_id, err)
        return False, None
    if not ambient:
        log.debug("pod %s: not ambient enabled, ignoring", pod_id)
        return False, pod
    socket_path = os.path.join(config.plugin.cni_agent_run_dir, EVENT_SOCKET)
    try:
        send(socket_path, event_body(args, previous, k8s), deadline)
    except EventError as err:
        raise PluginError(CONTACT_FAILED + str(err)) from None
    log.info("pod %s: ambient, handed to the node agent", pod_id)
    return True, pod


def _not_kubernetes(k8s: K8sArgs) -> bool:
    return k8s.pod_namespace == "" or k8s.pod_name == ""


def add(
    args: CmdArgs,
    *,
    programmer: Programmer,
    get_pod: PodGetter | None = None,
    get_namespace: NamespaceGetter | None = None,
    send_event: EventPoster | None = None,
    started: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """ADD: the result to print (the previous plugin's, unchanged); raises PluginError or CniError.

    ``get_pod`` and ``get_namespace`` replace the API client built from the kubeconfig, ``send_event``
    the POST to the node agent (tests); ``started`` is when the deadline started counting (default:
    now); ``environ`` is the invocation's environment (default: this process's).
    """
    begin = time.monotonic() if started is None else started
    config = _network_config(args)
    budget = config.plugin.add_timeout or DEFAULT_ADD_TIMEOUT
    deadline = begin + budget.total_seconds()
    try:
        previous = None if config.prev_result is None else result.parse(config.prev_result, args.cni_version)
    except result.ResultError as err:
        raise PluginError(f"cannot read prevResult as a {args.cni_version} result: {err}") from None
    answer = result.empty(args.cni_version) if previous is None else result.render(previous, args.cni_version)
    try:
        k8s = parse_k8s_args(args.args)
    except ArgsError as err:
        raise PluginError(str(err)) from None
    if is_agent_pod(k8s, config.plugin.pod_namespace):
        log.info("pod %s/%s is the node agent itself: no redirect", k8s.pod_namespace, k8s.pod_name)
        return answer
    if get_pod is None:
        get_pod, api_namespace = _api_getters(config)
        get_namespace = get_namespace or api_namespace
    if _not_kubernetes(k8s):
        log.info("container %s is not a kubernetes pod: no redirect", args.container_id)
        return answer
    if k8s.pod_namespace in config.plugin.exclude_namespaces:
        log.info("pod %s/%s is in an excluded namespace: no redirect", k8s.pod_namespace, k8s.pod_name)
        return answer
    if config.plugin.ambient_enabled:
        if get_namespace is None:
            get_namespace = _api_getters(config)[1]
        handled, pod = _ambient_add(
            args, k8s, config, previous, deadline, get_pod, get_namespace, send_event or post_event
        )
        if handled:
            return answer
        if pod is not None:  # the sidecar path decides on the pod just read
            read = pod
            get_pod = lambda namespace, name, deadline: read  # noqa: E731
    capture = plan(k8s, config, get_pod, deadline, os.environ if environ is None else environ)
    if capture is None:
        return answer
    from pathlib import Path  # only a pod that gets rules pays for it

    netns = Path(args.netns)
    if not netns.exists():
        raise PluginError(f"the pod's network namespace {netns} no longer exists")
    if time.monotonic() >= deadline:
        raise PluginError(
            f"the ADD deadline of {budget.total_seconds():g}s passed before the rules were set up"
        )
    programmer(capture, netns, deadline)
    log.info("pod %s/%s: redirect set up in %s (%s)", k8s.pod_namespace, k8s.pod_name, netns, capture.mode)
    return answer


def _network_config(args: CmdArgs) -> NetworkConfig:
    try:
        return parse_network_config(args.config)
    except ConfigError as err:
        raise PluginError(str(err)) from None


def _api_getters(config: NetworkConfig) -> tuple[PodGetter, NamespaceGetter]:
    """The pod and namespace GETs on the API server of install-cni's kubeconfig (read now: a bad file
    fails the ADD)."""
    from istio_agent.cni.kube import KUBECONFIG_NAME, KubeClient, read_kubeconfig

    try:
        client = KubeClient(read_kubeconfig(os.path.join(config.plugin.cni_agent_run_dir, KUBECONFIG_NAME)))
    except ConfigError as err:
        raise PluginError(str(err)) from None

    def get(namespace: str, name: str, deadline: float) -> dict[str, Any]:
        return client.get_pod_blocking(namespace, name, deadline=deadline)

    def get_namespace(name: str, deadline: float) -> dict[str, Any]:
        return client.get_namespace_blocking(name, deadline=deadline)

    return get, get_namespace


def cmd_add(args: CmdArgs, *, started: float | None = None) -> dict[str, Any]:
    """The executable's ADD handler: logging set up from the config, the programmer chosen from the
    environment and the config; PluginError becomes the CNI error result (code 999)."""
    try:
        plugin = _network_config(args).plugin
        _configure_logging(plugin.plugin_log_level)
        programmer = select_programmer(os.environ, native_nftables=plugin.native_nftables)
        return add(args, programmer=programmer, started=started)
    except PluginError as err:
        log.error("istio-cni cmdAdd error: %s", err)
        raise CniError(ERR_INTERNAL, str(err)) from None
