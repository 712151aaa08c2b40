"""``proxy-config all``: istioctl's PrintFullSummary (every table with a NAME column naming the type)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from istio_agent.ctl import secrets, secretsview
from istio_agent.ctl.configdump import clusters, endpoints, extensions, listeners, routes
from istio_agent.ctl.configdump.source import ConfigDumpError, Dump


def secrets_summary(dump: Dump, now: datetime) -> str:
    """The ``secret`` table of ``proxy-config secret`` (istioctl's columns), names prefixed ``secret/``.

    Only active and warming secrets, as istioctl asks Envoy for; VALID CERT is our secret view's
    (dates, and the chain against Envoy's trust bundles: docs/proxy-config-secret.md).
    """
    section = dump.section("SecretsConfigDump")
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
    """Each table and a blank line, in istioctl's order; the first that fails ends it, its error
    carrying what was printed before (:class:`PartialSummary`)."""
    tables: list[Callable[[], str]] = [
        lambda: extensions.bootstrap_summary(dump),
        lambda: clusters.summary(dump, cluster_filter, with_type=True),
        lambda: listeners.summary(dump, listener_filter, with_type=True),
        lambda: routes.summary(dump, route_filter, with_type=True),
        lambda: secrets_summary(dump, now or datetime.now(UTC)),
        lambda: endpoints.eds_summary(dump, endpoint_filter, with_type=True),
    ]
    printed: list[str] = []
    for table in tables:
        try:
            printed.append(table())
        except ConfigDumpError as err:
            raise PartialSummary("\n".join([*printed, ""]) if printed else "", str(err)) from None
    return "\n".join(printed)


class PartialSummary(ConfigDumpError):
    """A table failed: istioctl has printed the ones before it (``printed``), then the error."""

    def __init__(self, printed: str, message: str) -> None:
        super().__init__(message)
        self.printed = printed
