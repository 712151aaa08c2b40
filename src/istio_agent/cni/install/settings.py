"""install-cni's settings: Istio's flags, each also read from its environment variable, plus its env-only settings.

Istio (``cni/pkg/cmd/root.go``, cobra + viper) takes a flag when given, else the variable named
like it (upper case, ``-`` as ``_``), else the default. So does this module, with one difference: a
value that does not parse is an error naming the flag or variable, never silently the default.
Settings Istio registers but never reads (``cni-network-config``, ``log-level``...) are accepted and
ignored. The ``repair-*`` settings are Istio's ``RepairConfig`` (``cni/pkg/config/config.go``), read as
``cni/pkg/cmd/root.go`` reads them. With ``ambient-enabled`` the ambient node agent runs too
(:mod:`istio_agent.cni.ambient.nodeagent`): its settings are the ``AMBIENT_*`` variables Istio reads
through viper (no flags), ``ZTUNNEL_UDS_ADDRESS``, ``NATIVE_NFTABLES``, and the node agent's own
``NODE_NAME`` and ``SYSTEM_NAMESPACE`` (``cni/pkg/nodeagent/options.go``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from istio_agent.cni.plugin_config import DEFAULT_RUN_DIR, PluginConfig
from istio_agent.config.document import DocumentSyntaxError, load_document
from istio_agent.config.env import ConfigError, Env, out_of_range, parse_go_bool

if TYPE_CHECKING:  # the node agent's modules are imported only when ambient is enabled
    from istio_agent.cni.ambient.nodeagent import AmbientSettings

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
BIN_SOURCE_DIR = Path("/opt/cni/bin")
"""Where Istio's image keeps the plugin; every regular file there is copied to the host."""
BIN_TARGET_DIR = Path("/host/opt/cni/bin")
DEFAULT_OWNED_FILENAME = "02-istio-cni.conflist"
HEALTH_PORT = 8000
"""Istio's readiness port for the istio-cni-node DaemonSet (``/healthz``, ``/readyz``)."""
HOST_PROC_DIR = Path("/host/proc")
"""Where Istio's DaemonSet mounts the host's /proc (``cni-host-procfs``) for the repair controller."""
REPAIR_LABEL_KEY = "cni.istio.io/uninitialized"
_OCTAL = re.compile(r"0[0-7]+")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class Option:
    """One setting: its flag name, its environment variable and how its text is read."""

    flag: str
    kind: str  # "str", "bool", "int", "mode", "list"
    default: Any
    env_only: bool = False
    ours: bool = False
    """Not an Istio setting: one this implementation adds (documented in docs/cni.md)."""

    @property
    def env(self) -> str:
        return self.flag.upper().replace("-", "_")


OPTIONS = (
    Option("cni-conf-name", "str", ""),
    Option("chained-cni-plugin", "bool", True),
    Option("istio-owned-cni-config", "bool", False),
    Option("istio-owned-cni-config-filename", "str", ""),
    Option("mounted-cni-net-dir", "str", "/host/etc/cni/net.d"),
    Option("cni-agent-run-dir", "str", DEFAULT_RUN_DIR),
    Option("kubeconfig-mode", "mode", 0o600),
    Option("cni-conf-group-read", "bool", False),
    Option("kube-ca-file", "str", ""),
    Option("skip-tls-verify", "bool", False),
    Option("monitoring-port", "int", 15014),
    Option("ztunnel-uds-address", "str", "/var/run/ztunnel/ztunnel.sock"),
    Option("ambient-enabled", "bool", False),
    Option("enable-ambient-detection-retry", "bool", False),
    Option("repair-enabled", "bool", True),
    Option("repair-delete-pods", "bool", False),
    Option("repair-label-pods", "bool", False),
    Option("repair-broken-pod-label-key", "str", REPAIR_LABEL_KEY),
    Option("repair-broken-pod-label-value", "str", "true"),
    Option("repair-node-name", "str", ""),
    Option("repair-sidecar-annotation", "str", "sidecar.istio.io/status"),
    Option("repair-init-container-name", "str", "istio-validation"),
    Option("repair-init-container-termination-message", "str", ""),
    Option("repair-init-container-exit-code", "int", 126),
    Option("repair-label-selectors", "str", ""),
    Option("repair-field-selectors", "str", ""),
    # Registered by Istio but never read.
    Option("cni-network-config", "str", ""),
    Option("cni-network-config-file", "str", ""),
    Option("log-level", "str", ""),
    # Env-only in Istio.
    Option("repair-repair-pods", "bool", False, env_only=True),  # read by viper, never registered as a flag
    Option("exclude-namespaces", "list", (), env_only=True),
    Option("pod-namespace", "str", "", env_only=True),
    Option("native-nftables", "bool", False, env_only=True),
    Option("ambient-enablement-selector", "str", "", env_only=True),
    Option("ambient-dns-capture", "bool", False, env_only=True),
    Option("ambient-ipv6", "bool", False, env_only=True),
    Option("ambient-disable-safe-upgrade", "bool", False, env_only=True),
    Option("ambient-reconcile-pod-rules-on-startup", "bool", False, env_only=True),
    # Ours: Istio has these as constants; tests and non-Kubernetes hosts need them elsewhere.
    Option("cni-bin-source-dir", "str", str(BIN_SOURCE_DIR), ours=True),
    Option("cni-bin-target-dirs", "list", (str(BIN_TARGET_DIR),), ours=True),
    Option("service-account-dir", "str", str(SERVICE_ACCOUNT_DIR), ours=True),
    Option("health-port", "int", HEALTH_PORT, ours=True),
    Option("host-proc-dir", "str", str(HOST_PROC_DIR), ours=True),
)
FLAGS = tuple(option for option in OPTIONS if not option.env_only)


@dataclass(frozen=True)
class RepairSettings:
    """The repair controller's settings: Istio's ``RepairConfig``, defaults as its flags' (the chart
    turns ``repair_pods`` on with ``REPAIR_REPAIR_PODS=true`` and sets ``REPAIR_NODE_NAME``)."""

    enabled: bool = True
    repair_pods: bool = False
    """Program the pod's redirect in place (needs the host's /proc and CAP_SYS_ADMIN, no RBAC)."""
    delete_pods: bool = False
    label_pods: bool = False
    label_key: str = REPAIR_LABEL_KEY
    label_value: str = "true"
    node_name: str = ""
    sidecar_annotation: str = "sidecar.istio.io/status"
    init_container_name: str = "istio-validation"
    init_termination_message: str = ""
    init_exit_code: int = 126
    label_selectors: str = ""
    field_selectors: str = ""
    native_nftables: bool = False
    host_proc_dir: Path = HOST_PROC_DIR
    """Ours: Istio reads ``/host/proc`` always; tests point this at the real ``/proc``."""

    @property
    def mode(self) -> str | None:
        """What a broken pod gets, in Istio's order of precedence: repair, delete, label; None: nothing."""
        if self.repair_pods:
            return "repair"
        if self.delete_pods:
            return "delete"
        if self.label_pods:
            return "label"
        return None


@dataclass(frozen=True)
class InstallSettings:
    """Everything install-cni runs on, read once at start."""

    cni_conf_name: str = ""
    chained_cni_plugin: bool = True
    istio_owned_cni_config: bool = False
    istio_owned_cni_config_filename: str = ""
    mounted_cni_net_dir: Path = Path("/host/etc/cni/net.d")
    cni_agent_run_dir: Path = Path(DEFAULT_RUN_DIR)
    kubeconfig_mode: int = 0o600
    cni_conf_group_read: bool = False
    kube_ca_file: str = ""
    skip_tls_verify: bool = False
    monitoring_port: int = 15014
    health_port: int = HEALTH_PORT
    cni_bin_source_dir: Path = BIN_SOURCE_DIR
    cni_bin_target_dirs: tuple[Path, ...] = (BIN_TARGET_DIR,)
    service_account_dir: Path = SERVICE_ACCOUNT_DIR
    repair: RepairSettings = field(default_factory=RepairSettings)
    kubernetes_service_protocol: str = "https"
    kubernetes_service_host: str = ""
    kubernetes_service_port: str = ""
    plugin: PluginConfig = field(default_factory=PluginConfig)
    """Our entry in the CNI config, as the plugin will read it."""
    ambient: AmbientSettings | None = None
    """The ambient node agent's settings; None when ambient is not enabled."""
    ambient_disable_safe_upgrade: bool = False

    @property
    def conf_file_mode(self) -> int:
        """The mode of a config file we create (an existing one keeps its own)."""
        return 0o640 if self.cni_conf_group_read else 0o600

    @property
    def ca_file(self) -> Path:
        return Path(self.kube_ca_file) if self.kube_ca_file else self.service_account_dir / "ca.crt"

    @property
    def kubeconfig_path(self) -> Path:
        return self.cni_agent_run_dir / "istio-cni-kubeconfig"


def load_settings(
    flags: Mapping[str, str | None],
    environ: Mapping[str, str] | None = None,
    *,
    plugin_log_level: str = "info",
) -> InstallSettings:
    """Settings from flags given on the command line (name -> text, None when not given) and the environment.

    Raises ConfigError naming the flag or variable of the first bad value.
    """
    env = Env(environ)
    values = {option.flag: _read(option, flags.get(option.flag), env) for option in OPTIONS}
    port_problem = out_of_range(values["monitoring-port"], None, 65535)
    if port_problem:
        raise ConfigError(f"invalid value for --monitoring-port={values['monitoring-port']}: {port_problem}")
    health_problem = out_of_range(values["health-port"], 0, 65535)
    if health_problem:
        raise ConfigError(f"invalid value for --health-port={values['health-port']}: {health_problem}")
    if not values["cni-bin-target-dirs"]:
        raise ConfigError("--cni-bin-target-dirs: at least one directory is needed")
    owned = values["istio-owned-cni-config"]
    run_dir = values["cni-agent-run-dir"]
    plugin = PluginConfig(
        plugin_log_level=plugin_log_level,
        cni_agent_run_dir=run_dir,
        ambient_enabled=values["ambient-enabled"],
        enablement_selectors=_selectors(values["ambient-enablement-selector"]),
        exclude_namespaces=tuple(values["exclude-namespaces"]),
        pod_namespace=values["pod-namespace"],
        native_nftables=values["native-nftables"],
        enable_ambient_detection_retry=values["enable-ambient-detection-retry"],
    )
    return InstallSettings(
        cni_conf_name=values["cni-conf-name"],
        chained_cni_plugin=values["chained-cni-plugin"],
        istio_owned_cni_config=owned,
        istio_owned_cni_config_filename=values["istio-owned-cni-config-filename"]
        or (DEFAULT_OWNED_FILENAME if owned else ""),
        mounted_cni_net_dir=Path(values["mounted-cni-net-dir"]),
        cni_agent_run_dir=Path(run_dir),
        kubeconfig_mode=values["kubeconfig-mode"],
        cni_conf_group_read=values["cni-conf-group-read"],
        kube_ca_file=values["kube-ca-file"],
        skip_tls_verify=values["skip-tls-verify"],
        monitoring_port=values["monitoring-port"],
        health_port=values["health-port"],
        cni_bin_source_dir=Path(values["cni-bin-source-dir"]),
        cni_bin_target_dirs=tuple(Path(d) for d in values["cni-bin-target-dirs"]),
        service_account_dir=Path(values["service-account-dir"]),
        repair=_repair(values),
        kubernetes_service_protocol=env.text("KUBERNETES_SERVICE_PROTOCOL") or "https",
        kubernetes_service_host=env.text("KUBERNETES_SERVICE_HOST"),
        kubernetes_service_port=env.text("KUBERNETES_SERVICE_PORT"),
        plugin=plugin,
        ambient=_ambient(values, plugin, env) if values["ambient-enabled"] else None,
        ambient_disable_safe_upgrade=values["ambient-disable-safe-upgrade"],
    )


def _ambient(values: Mapping[str, Any], plugin: PluginConfig, env: Env) -> AmbientSettings:
    """The node agent's settings (Istio's ``AmbientArgs`` from ``root.go``); the enablement selectors
    are compiled now, so a bad one stops install-cni as it stops Istio's."""
    import socket

    from istio_agent.cni.ambient.nodeagent import AmbientSettings
    from istio_agent.cni.ambient.selectors import SelectorError, compile_selectors
    from istio_agent.cni.ambient.settings import InpodSettings

    try:
        selectors = compile_selectors(plugin.enablement_selectors, "AMBIENT_ENABLEMENT_SELECTOR")
    except SelectorError as err:
        raise ConfigError(f"failed to instantiate ambient enablement selector: {err}") from None
    node_name = env.text("NODE_NAME") or env.text("KUBERNETES_NODE_NAME") or socket.gethostname()
    return AmbientSettings(
        selectors=selectors,
        ztunnel_socket=Path(values["ztunnel-uds-address"]),
        node_name=node_name,
        system_namespace=env.text("SYSTEM_NAMESPACE") or "istio-system",
        inpod=InpodSettings(
            dns_capture=values["ambient-dns-capture"],
            ipv6=values["ambient-ipv6"],
            reconcile=values["ambient-reconcile-pod-rules-on-startup"],
            native_nftables=values["native-nftables"],
        ),
        host_proc_dir=Path(values["host-proc-dir"]),
        switch_to_host_netns=env.flag("ALLOW_SWITCH_TO_HOST_NS"),
    )


def _repair(values: Mapping[str, Any]) -> RepairSettings:
    """The repair settings; a label the API server would refuse is an error now, not on every pod."""
    repair = RepairSettings(
        enabled=values["repair-enabled"],
        repair_pods=values["repair-repair-pods"],
        delete_pods=values["repair-delete-pods"],
        label_pods=values["repair-label-pods"],
        label_key=values["repair-broken-pod-label-key"],
        label_value=values["repair-broken-pod-label-value"],
        node_name=values["repair-node-name"],
        sidecar_annotation=values["repair-sidecar-annotation"],
        init_container_name=values["repair-init-container-name"],
        init_termination_message=values["repair-init-container-termination-message"],
        init_exit_code=values["repair-init-container-exit-code"],
        label_selectors=values["repair-label-selectors"],
        field_selectors=values["repair-field-selectors"],
        native_nftables=values["native-nftables"],
        host_proc_dir=Path(values["host-proc-dir"]),
    )
    if repair.enabled and repair.mode == "label":
        problem = _label_key_problem(repair.label_key)
        if problem:
            raise ConfigError(
                f"invalid value for --repair-broken-pod-label-key={repair.label_key!r}: {problem}"
            )
        value = repair.label_value
        if value and (len(value) > 63 or not _LABEL_NAME.fullmatch(value)):
            raise ConfigError(
                f"invalid value for --repair-broken-pod-label-value={value!r}: a label value is at most 63 "
                "letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
            )
    return repair


def _label_key_problem(key: str) -> str | None:
    """Why ``key`` is not a label key (``[DNS subdomain/]name``), as the API server would refuse it."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return "the prefix before '/' must be a lowercase DNS subdomain"
    if not name or len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        return "the name must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
    return None


def _read(option: Option, flag_text: str | None, env: Env) -> Any:
    """The flag's value when given, else the variable's, else the default; parsed by the option's kind."""
    if flag_text is not None:
        where, text = f"--{option.flag}", flag_text
    elif option.env in env and env.text(option.env) != "":
        where, text = option.env, env.text(option.env)
    else:
        return option.default
    try:
        return _parse(option.kind, text)
    except ValueError as err:
        raise ConfigError(f"invalid value for {where}={text!r}: {err}") from None


def _parse(kind: str, text: str) -> Any:
    if kind == "bool":
        return parse_go_bool(text)
    if kind == "int":
        return int(text.strip(), 10)
    if kind == "mode":
        return _file_mode(text)
    if kind == "list":
        return tuple(item.strip() for item in text.split(",") if item.strip())
    return text


def _file_mode(text: str) -> int:
    """A file mode as Go reads an int flag (base prefix honoured: ``0600``, ``0o600``, ``384``)."""
    value = text.strip()
    mode = int(value, 8) if _OCTAL.fullmatch(value) else int(value, 0)
    problem = out_of_range(mode, 0, 0o777, oct)
    if problem:
        raise ValueError(f"a file mode {problem}")
    return mode


def _selectors(text: str) -> tuple[dict[str, Any], ...]:
    """AMBIENT_ENABLEMENT_SELECTOR: a YAML list of ``{podSelector, namespaceSelector}`` (passed to the plugin)."""
    if not text.strip():
        return ()
    try:
        document = load_document(text)
    except DocumentSyntaxError as err:
        raise ConfigError(f"invalid value for AMBIENT_ENABLEMENT_SELECTOR: {err}") from None
    if not isinstance(document, list) or not all(isinstance(item, dict) for item in document):
        raise ConfigError("invalid value for AMBIENT_ENABLEMENT_SELECTOR: expected a list of selectors")
    return tuple(document)
