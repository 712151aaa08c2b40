"""An optional TTL cache of upstream answers (DNS_CACHE=true), beyond Istio's agent.

Istio forwards every query it cannot answer from the name table; with the cache a repeated external
name costs a dictionary lookup instead of an upstream round trip. Entries live exactly as long as
their records may be cached by anyone (RFC 1035 §3.2.1, RFC 2308 for NXDOMAIN/NODATA), and a hit
comes back with its TTLs aged, so downstream caches never hold a record past its upstream lifetime.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from istio_agent.dns.records import TYPE_OPT, TYPE_SOA
from istio_agent.dns.wire import (
    FLAG_CD,
    OPCODE_MASK,
    OPCODE_SHIFT,
    RCODE_NOERROR,
    RCODE_NXDOMAIN,
    DnsFormatError,
    Query,
    ttl_offsets,
)
from istio_agent.metrics import Registry

_MAX_TTL = 0x7FFFFFFF
"""RFC 2181 §8: a TTL with the top bit set counts as zero."""

_CacheKey = tuple[str, int, int, int, bool, bool]


@dataclass(frozen=True, slots=True)
class _Entry:
    reply: bytes
    ttls: tuple[tuple[int, int], ...]
    """(offset, TTL) of every record TTL in ``reply`` (never the OPT pseudo-record's)."""
    stored: float
    expires: float


_KEY_FLAGS = FLAG_CD | (OPCODE_MASK << OPCODE_SHIFT)


def _key(parsed: Query) -> _CacheKey:
    # EDNS presence is part of the key: a client that sent no OPT must not get one back (RFC 6891 §7).
    # So are CD (a reply fetched with checking disabled may be bogus for a validating client) and the opcode.
    return (
        parsed.qname.lower(),
        parsed.qtype,
        parsed.qclass,
        parsed.flags & _KEY_FLAGS,
        parsed.do_bit,
        parsed.edns,
    )


def cacheable_ttl(reply: bytes) -> tuple[int, tuple[tuple[int, int], ...]] | None:
    """How long ``reply`` may be cached, and where its TTLs are; None when it must not be cached.

    SERVFAIL, REFUSED and friends, truncated replies and malformed ones are never cached. A positive
    answer lives for its smallest TTL; NXDOMAIN and NODATA for min(SOA TTL, SOA MINIMUM) of the
    authority SOA, and not at all without one (RFC 2308 §5).
    """
    if len(reply) < 12:
        return None
    if reply[2] & 0x02:  # TC: the client will ask again over TCP, which gives the whole answer
        return None
    rcode = reply[3] & 0x0F
    if rcode not in (RCODE_NOERROR, RCODE_NXDOMAIN):
        return None
    ancount, nscount = struct.unpack_from("!HH", reply, 6)
    try:
        offsets = ttl_offsets(reply)
    except DnsFormatError:
        return None
    ttls: list[tuple[int, int]] = []
    soa_ttl: int | None = None
    soa_index = 0
    for index, offset in enumerate(offsets):
        rtype, _, ttl = struct.unpack_from("!HHI", reply, offset - 4)
        if rtype == TYPE_OPT:
            continue
        if ttl > _MAX_TTL:
            ttl = 0
        ttls.append((offset, ttl))
        if rtype == TYPE_SOA and ancount <= index < ancount + nscount and soa_ttl is None:
            (rdlength,) = struct.unpack_from("!H", reply, offset + 4)
            if rdlength < 20:
                return None
            (minimum,) = struct.unpack_from("!I", reply, offset + 6 + rdlength - 4)
            soa_ttl = min(ttl, minimum if minimum <= _MAX_TTL else 0)
            soa_index = len(ttls) - 1
    if rcode == RCODE_NXDOMAIN or ancount == 0:
        if soa_ttl is None:
            return None
        lifetime = soa_ttl
        # Clients cache a negative answer for min(SOA TTL, MINIMUM) of what they get: aging the SOA
        # from the negative lifetime keeps the total within it (RFC 2308 §5).
        ttls[soa_index] = (ttls[soa_index][0], soa_ttl)
    elif ttls:
        lifetime = min(ttl for _, ttl in ttls)
    else:
        return None
    if lifetime <= 0:
        return None
    return lifetime, tuple(ttls)


class _CacheMetrics:
    """The answer cache's metrics."""

    def __init__(self, registry: Registry) -> None:
        self.hits = registry.counter(
            "dns_cache_hits_total", "Upstream DNS answers served from the agent's answer cache."
        )
        self.misses = registry.counter(
            "dns_cache_misses_total", "Forwarded DNS queries not found in the agent's answer cache."
        )


class AnswerCache:
    """Upstream replies by (name, type, class, DO bit, EDNS), held for their TTL, oldest evicted first."""

    def __init__(
        self,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        *,
        registry: Registry,
    ) -> None:
        self._metrics = _CacheMetrics(registry)
        if max_entries < 1:
            raise ValueError(f"DNS cache size must be at least 1, got {max_entries}")
        self._max_entries = max_entries
        self._clock = clock
        self._entries: dict[_CacheKey, _Entry] = {}  # insertion order = age order

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, parsed: Query) -> bytes | None:
        """The cached reply with the client's ID and TTLs aged by the elapsed whole seconds, or None.

        The question is spelled as the client spelled it: resolvers that randomise the case of the
        name (DNS 0x20) reject a reply that does not echo it exactly.
        """
        key = _key(parsed)
        entry = self._entries.get(key)
        if entry is None:
            self._metrics.misses.inc()
            return None
        now = self._clock()
        if now >= entry.expires:
            del self._entries[key]
            self._metrics.misses.inc()
            return None
        out = bytearray(entry.reply)
        struct.pack_into("!H", out, 0, parsed.id)
        question = parsed.question
        end = 12 + len(question)
        if out[12:end] != question and out[12:end].lower() == question.lower():
            out[12:end] = question
        elapsed = int(now - entry.stored)
        if elapsed > 0:
            for offset, ttl in entry.ttls:
                struct.pack_into("!I", out, offset, max(ttl - elapsed, 0))
        self._metrics.hits.inc()
        return bytes(out)

    def put(self, parsed: Query, reply: bytes) -> None:
        """Remember ``reply`` for ``parsed`` when it may be cached (see ``cacheable_ttl``).

        Replies to queries with EDNS options are not kept: cookies and client-subnet answers belong to
        the client that asked.
        """
        if parsed.edns_options:
            return
        verdict = cacheable_ttl(reply)
        if verdict is None:
            return
        lifetime, ttls = verdict
        stored = bytearray(reply)
        for offset, ttl in ttls:  # as served at age 0 (the negative SOA TTL, RFC 2181 §8 zeroes)
            struct.pack_into("!I", stored, offset, ttl)
        reply = bytes(stored)
        key = _key(parsed)
        entries = self._entries
        entries.pop(key, None)
        while len(entries) >= self._max_entries:
            del entries[next(iter(entries))]
        now = self._clock()
        entries[key] = _Entry(reply, ttls, now, now + lifetime)

    def clear(self) -> None:
        self._entries.clear()
