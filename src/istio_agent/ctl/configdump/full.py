"""``proxy-config all``: istioctl's PrintFullSummary (every table with a NAME column naming the type)."""

from __future__ import annotations

from datetime import UTC, datetime

from istio_agent.ctl import secrets, secretsview
from istio_agent.ctl.configdump import clusters, endpoints, extensions, listeners, routes
from istio_agent.ctl.configdump.source import ConfigDumpError, Dump


def secrets_summary(dump: Dump, now: datetime) -> str:
    """The ``secret`` table of ``proxy-config secret`` (istioctl's columns), names prefixed ``secret/``.

    Only active and warming secrets, as istioctl asks Envoy for; VALID CERT is our secret view's
    (dates, and the chain against Envoy's trust bundles: docs/proxy-config-secret.md).
    """
    try:
        section = secrets.secrets_dump({"configs": dump.configs}, "config dump")
    except secrets.SecretsError as err:
        raise ConfigDumpError(str(err)) from None
    if not secrets.has_active_or_warming(section):
        return secretsview.NO_DYNAMIC
    items = [item for item in secrets.envoy_items(section, now) if item.state != "STATIC"]
    for item in items:
        item.name = f"secret/{item.name}"
    return secretsview.summary_table(items, now=now)


def summary(
    dump: Dump,
    cluster_filter: clusters.ClusterFilter,
    listener_filter: listeners.ListenerFilter,
    route_filter: routes.RouteFilter,
    endpoint_filter: endpoints.EndpointFilter,
    now: datetime | None = None,
) -> str:
    parts = [
        extensions.bootstrap_summary(dump),
        clusters.summary(dump, cluster_filter, with_type=True),
        listeners.summary(dump, listener_filter, with_type=True),
        routes.summary(dump, route_filter, with_type=True),
        secrets_summary(dump, now or datetime.now(UTC)),
        endpoints.eds_summary(dump, endpoint_filter, with_type=True),
    ]
    return "\n".join(parts)
