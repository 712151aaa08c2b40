"""What a client of an xDS server watches, and how each request changes it: the SotW and Delta rules.

Pure bookkeeping, no I/O: :mod:`istio_agent.xds.stream` feeds each request of a stream through
:func:`sotw_request` or :func:`delta_request` and answers with what the returned :class:`Decision`
says. The rules are Istio's shared ones (``pkg/xds/server.go`` ``ShouldRespond`` for SotW, used by
istiod and by the agent's SDS server ``security/pkg/nodeagent/sds/sdsservice.go``;
``pilot/pkg/xds/delta.go`` for Delta):

* a NACK (``error_detail``) is recorded when it answers the last response of the type, and is
  never answered, so a rejected configuration cannot turn into a NACK loop;
* a nonce that is not the last one sent for the type is stale: SotW ignores the request, Delta
  still applies its subscription changes;
* SotW: a request without names unsubscribes (except for wildcard types, whose names are ignored);
  one without a nonce, or the first for a type (even with a nonce, as after a server restart),
  subscribes and is answered in full; an ACK that changes the names is answered;
* Delta: names subscribed explicitly are (re)sent, unless the client says in
  ``initial_resource_versions`` that it holds them already; ``*`` subscribes to a wildcard type.

Where servers differ, :class:`Policy` says so.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from istio_agent.xds.flavour import unique

MAX_ERROR_TEXT = 1024
"""NACK messages come from the client; status and logs keep at most this much of one."""


@dataclass(frozen=True)
class Policy:
    """The protocol choices that differ between the servers built on the stream core."""

    wildcard_types: frozenset[str] = frozenset()
    """Types a client gets in full (istiod's CDS, LDS, ...); their SotW resource names are ignored."""
    ack_sends_added_only: bool = False
    """SotW: an ACK that adds names is answered with only the added ones, and one that only removes
    names is not answered (Istio's SDS server); otherwise the type's full set is resent (istiod)."""
    answer_first_delta: bool = False
    """Delta: answer the first request of a type even when there is nothing to send (istiod: the
    client waits for it to finish initialising)."""


@dataclass(frozen=True)
class TypeStatus:
    """Where one watched type of one stream stands (what istiod's syncz reports)."""

    type_url: str
    sent_nonce: str
    acked_nonce: str
    version: str
    """version_info (SotW) or system_version_info (Delta) of the last response."""
    error: str | None
    """The message of the client's NACK of the last response; None once it ACKs."""
    last_sent: float | None
    """Wall-clock time (``time.time()``) of the last response."""
    resources: int
    """Resources the client holds according to what was sent."""

    @property
    def config_status(self) -> str:
        """istiod's syncz status (``debugSyncStatus`` in ``pilot/pkg/xds/statusgen.go``, since 1.23):
        ERROR while the client's last word on the type is a NACK (its text in :attr:`error`), else
        NOT_SENT, SYNCED or STALE (sent, not yet acknowledged)."""
        if self.error is not None:
            return "ERROR"
        if not self.sent_nonce:
            return "NOT_SENT"
        return "SYNCED" if self.acked_nonce == self.sent_nonce else "STALE"


@dataclass
class Watch:
    """One type a stream's client watches, and what was sent and acknowledged for it."""

    type_url: str
    wildcard: bool = False
    names: dict[str, None] = field(default_factory=dict)
    """The names asked for, in order (SotW: the last request's; Delta: those subscribed)."""
    client_versions: dict[str, str] = field(default_factory=dict)
    """Delta: name -> version the client holds (its initial versions, then what was sent)."""
    sent_nonce: str = ""
    acked_nonce: str = ""
    version: str = ""
    error: str | None = None
    last_sent: float | None = None
    resources: int = 0

    def wants(self, name: str) -> bool:
        return self.wildcard or name in self.names

    def sent(self, nonce: str, version: str, resources: int) -> None:
        self.sent_nonce = nonce
        self.version = version
        self.last_sent = time.time()
        self.resources = resources

    def status(self) -> TypeStatus:
        return TypeStatus(
            type_url=self.type_url,
            sent_nonce=self.sent_nonce,
            acked_nonce=self.acked_nonce,
            version=self.version,
            error=self.error,
            last_sent=self.last_sent,
            resources=self.resources,
        )


class Verdict(enum.Enum):
    """How a request relates to what the stream was sent before."""

    SUBSCRIBE = "subscribe"
    """A first, repeated or spontaneous request (no nonce to match)."""
    ACK = "ack"
    NACK = "nack"
    """The client rejected a response; :attr:`Decision.watch` is set when it was the last one sent."""
    STALE = "stale"
    UNSUBSCRIBE = "unsubscribe"


@dataclass(slots=True)
class Send:
    """What to answer a request with."""

    names: tuple[str, ...] | None
    """The names the answer concerns; None: everything the watch wants."""
    always: bool = True
    """Answer even when nothing changed for the client (Delta only; SotW requests always are)."""


@dataclass(slots=True)
class Decision:
    verdict: Verdict
    watch: Watch | None
    send: Send | None = None


def error_text(request: Any) -> str:
    """The client's NACK message, bounded; its code when the message is empty."""
    message = str(request.error_detail.message) or f"code {request.error_detail.code}"
    return message[:MAX_ERROR_TEXT]


def _nack(watch: Watch | None, request: Any) -> Decision:
    nonce = request.response_nonce
    if watch is None or not nonce or nonce != watch.sent_nonce:
        return Decision(Verdict.NACK, None)
    watch.acked_nonce = nonce
    watch.error = error_text(request)
    return Decision(Verdict.NACK, watch)


def _ack(watch: Watch, nonce: str) -> None:
    watch.acked_nonce = nonce
    watch.error = None


def sotw_request(watches: dict[str, Watch], type_url: str, request: Any, policy: Policy) -> Decision:
    """Apply one DiscoveryRequest for ``type_url`` to ``watches``."""
    watch = watches.get(type_url)
    if request.HasField("error_detail"):
        return _nack(watch, request)
    wildcard = type_url in policy.wildcard_types
    names = [] if wildcard else unique(request.resource_names)
    if not names and not wildcard:
        watches.pop(type_url, None)
        return Decision(Verdict.UNSUBSCRIBE, watch)
    nonce = request.response_nonce
    if watch is None or not nonce:
        if watch is None:
            watch = watches[type_url] = Watch(type_url, wildcard=wildcard)
        watch.names = dict.fromkeys(names)
        return Decision(Verdict.SUBSCRIBE, watch, Send(None))
    if nonce != watch.sent_nonce:
        return Decision(Verdict.STALE, watch)
    _ack(watch, nonce)
    previous, watch.names = watch.names, dict.fromkeys(names)
    if previous.keys() == watch.names.keys():
        return Decision(Verdict.ACK, watch)
    if not policy.ack_sends_added_only:
        return Decision(Verdict.ACK, watch, Send(None))
    added = tuple(name for name in names if name not in previous)
    return Decision(Verdict.ACK, watch, Send(added) if added else None)


def delta_request(watches: dict[str, Watch], type_url: str, request: Any, policy: Policy) -> Decision:
    """Apply one DeltaDiscoveryRequest for ``type_url`` to ``watches``."""
    watch = watches.get(type_url)
    if request.HasField("error_detail"):
        return _nack(watch, request)
    nonce = request.response_nonce
    verdict = Verdict.SUBSCRIBE
    if watch is not None and nonce:
        if nonce == watch.sent_nonce:
            _ack(watch, nonce)
            verdict = Verdict.ACK
        else:
            verdict = Verdict.STALE
    subscribe = unique(request.resource_names_subscribe)
    wildcard_type = type_url in policy.wildcard_types
    first = watch is None
    initial: dict[str, str] = {}
    if watch is None:
        watch = watches[type_url] = Watch(
            type_url, wildcard=wildcard_type and (not subscribe or "*" in subscribe)
        )
        # Versions the client kept from an earlier stream matter when the type is (re)opened.
        initial = dict(request.initial_resource_versions)
        watch.client_versions = dict(initial)
    everything = first and watch.wildcard
    concerned = []
    for name in unique([*subscribe, *initial]):
        if name == "*":
            if wildcard_type and not watch.wildcard:
                watch.wildcard = everything = True
            continue  # "*" on a type that is never wildcard means nothing
        if name not in initial:
            watch.client_versions.pop(name, None)  # asked for again: sent again
        elif watch.wildcard:
            continue  # held under the wildcard: not a name of its own
        watch.names[name] = None
        concerned.append(name)
    for name in request.resource_names_unsubscribe:
        if name == "*":
            watch.wildcard = False
        else:
            watch.names.pop(name, None)
    if not watch.wildcard:
        wanted = watch.names
        for name in [name for name in watch.client_versions if name not in wanted]:
            del watch.client_versions[name]  # no longer wanted: the client drops it itself
        concerned = [name for name in concerned if name in wanted]
    names = None if everything else tuple(concerned)
    return Decision(verdict, watch, Send(names, always=first and policy.answer_first_delta))
