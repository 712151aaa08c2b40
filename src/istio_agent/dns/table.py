"""The agent's authoritative name table, built from each NDS push and queried per request.

The build follows Istio's UpdateLookupTable (pkg/dns/client/dns.go).

Everything that does not depend on the question is computed once in ``build()``: a query for a name
in the table is a single dictionary lookup that returns a prebuilt ``Answer``. Only wildcard hits
(owner names copied from the question) do work per query, and only after the exact lookup missed.
"""

from __future__ import annotations

import ipaddress
import random
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from istio_agent.dns.records import TTL, TYPE_A, TYPE_AAAA, TYPE_CNAME, TYPE_MX, Record
from istio_agent.log import scope
from istio_agent.protos import nds_pb2

log = scope("dns")
_T = TypeVar("_T")

KUBERNETES = "Kubernetes"


class Answer(NamedTuple):
    """Records of a local reply: CNAME (if any) first, then A/AAAA. Empty means NODATA (NOERROR, AA)."""

    records: tuple[Record, ...]


NODATA = Answer(())


@dataclass(frozen=True, slots=True)
class _Wildcard:
    """What a wildcard key answers for one qtype; owner names are filled in from the question."""

    cname: Record | None
    addresses: tuple[Record, ...]

    def answer(self, question: str) -> Answer:
        if not self.addresses:
            return NODATA  # the CNAME is dropped with the empty answer
        if self.cname is not None:
            # Owner of the addresses stays the CNAME target, the literal "*.x." name.
            cn = self.cname
            return Answer((Record(question, cn.rtype, cn.ttl, cn.rdata), *self.addresses))
        return Answer(tuple([Record(question, r.rtype, r.ttl, r.rdata) for r in self.addresses]))


class _Address(NamedTuple):
    """One parsed NDS IP: its text in canonical form and its record type and data."""

    text: str
    rtype: int
    rdata: bytes


def _parse_ip(raw: str) -> _Address | None:
    """Parse like Go's netip.ParseAddr: v4-mapped v6 stays v6, zones are kept; None when unparsable."""
    if ":" not in raw:
        # inet_pton is strict dotted-quad without leading zeros, so the text is already canonical.
        try:
            return _Address(raw, TYPE_A, socket.inet_pton(socket.AF_INET, raw))
        except (OSError, ValueError):  # ValueError: NUL or characters that do not encode
            return None
    try:
        ip = ipaddress.ip_address(raw)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv4Address):
        return _Address(str(ip), TYPE_A, ip.packed)
    mapped = ip.ipv4_mapped
    text = f"::ffff:{mapped}" if mapped is not None and ip.scope_id is None else str(ip)
    return _Address(text, TYPE_AAAA, ip.packed)


def _wire(name: str) -> bytes | None:
    """Wire form of an FQDN ending in a dot (as encode_name, but fast), None when it is not valid."""
    raw = name.encode()
    labels = raw.split(b".")
    if labels.pop() or len(raw) > 254:
        return None
    out = bytearray()
    for label in labels:
        if not 0 < len(label) < 64:
            return None
        out.append(len(label))
        out += label
    out.append(0)
    return bytes(out)


def _alt_hosts(
    hostname: str,
    info: nds_pb2.NameTable.NameInfo,
    proxy_namespace: str,
    proxy_domain: str,
    domain_first_label: str,
) -> list[str]:
    """The names a table entry answers to, in generation order, before lower-casing."""
    if info.registry != KUBERNETES:
        return [hostname if hostname.endswith(".") else hostname + "."]
    if hostname.endswith("."):
        return []  # Istio drops a Kubernetes host given as an FQDN with the dot
    hosts = [hostname + "."]
    if not proxy_domain or not hostname.endswith(proxy_domain):
        return hosts  # another cluster domain: only the FQDN, alt_hosts ignored
    short, namespace = info.shortname, info.namespace
    if short and namespace:
        # Istio would also emit "." / "..svc." style names for entries lacking these; we do not.
        hosts.append(f"{short}.{namespace}.")
        if namespace == proxy_namespace:
            hosts.append(f"{short}.")
        hosts.append(f"{short}.{namespace}.{domain_first_label}.")
    hosts.extend(alt + "." for alt in info.alt_hosts)
    return hosts


class LookupTable:
    """Names the agent answers for, from one NameTable push; immutable once built."""

    __slots__ = ("_a", "_aaaa", "_generated", "_name_table", "_wildcard_a", "_wildcard_aaaa")

    def __init__(
        self,
        a: dict[str, Answer],
        aaaa: dict[str, Answer],
        wildcard_a: dict[str, _Wildcard],
        wildcard_aaaa: dict[str, _Wildcard],
        name_table: nds_pb2.NameTable,
        generated: dict[str, tuple[str, ...]],
    ) -> None:
        self._a = a
        self._aaaa = aaaa
        self._wildcard_a = wildcard_a
        self._wildcard_aaaa = wildcard_aaaa
        self._name_table = name_table
        self._generated = generated

    @classmethod
    def build(
        cls,
        name_table: nds_pb2.NameTable,
        *,
        proxy_namespace: str,
        proxy_domain: str,
        search_domains: Sequence[str],
    ) -> LookupTable:
        """Build the table as Istio's UpdateLookupTable does (pkg/dns/client/dns.go); bad entries are skipped.

        A big table is hundreds of thousands of small acyclic objects: callers that build one should
        pause the cyclic collector meanwhile (see ``istio_agent.dns.proxy.CollectorPause``).
        """
        domain_first_label = proxy_domain.split(".", 1)[0]
        # Only the first search domain gets the CNAME shortcut. Lower-cased so the suffix test below
        # is case-insensitive (Istio compares the raw resolv.conf text).
        search = search_domains[0].lower() if search_domains else None
        search_suffix = "" if search is None else (search if search.endswith(".") else search + ".")

        suffix_wire = _wire(search_suffix) if search is not None else None
        if search is not None and suffix_wire is None:
            log.warning("search domain %r is not a valid DNS name; no search shortcut", search)

        all_hosts: dict[str, None] = {}  # insertion-ordered set
        name4: dict[str, Answer] = {}  # owner is the key
        name6: dict[str, Answer] = {}
        cname: dict[str, tuple[Record, str]] = {}  # expanded name -> (CNAME record, target)
        wildcard_keys: list[str] = []
        generated: dict[str, tuple[str, ...]] = {}  # alt host -> ips (v4 then v6), for /debug/ndsz
        parsed_ips: dict[str, _Address | None] = {}  # the same IP is often listed under many hosts
        unparsable: list[str] = []

        for hostname, info in name_table.table.items():
            alt_hosts = _alt_hosts(hostname, info, proxy_namespace, proxy_domain, domain_first_label)
            if not alt_hosts:
                log.debug("skipping Kubernetes host %r: it ends with a dot", hostname)
                continue
            v4: list[bytes] = []
            v6: list[bytes] = []
            v4_text: list[str] = []
            v6_text: list[str] = []
            for raw in info.ips:
                if raw in parsed_ips:
                    address = parsed_ips[raw]
                else:
                    address = parsed_ips[raw] = _parse_ip(raw)
                if address is None:
                    unparsable.append(hostname)
                elif address.rtype == TYPE_A:
                    v4.append(address.rdata)
                    v4_text.append(address.text)
                else:
                    v6.append(address.rdata)
                    v6_text.append(address.text)
            if not v4 and not v6:
                log.debug("skipping host %r: no usable IP", hostname)
                continue
            ips_text = (*v4_text, *v6_text)
            lowered = {h.lower() for h in alt_hosts}
            for host in lowered:
                all_hosts[host] = None
                generated[host] = ips_text
                if host.startswith("*."):
                    wildcard_keys.append(host)
                if v4:
                    name4[host] = Answer(tuple([Record(host, TYPE_A, TTL, rdata) for rdata in v4]))
                if v6:
                    name6[host] = Answer(tuple([Record(host, TYPE_AAAA, TTL, rdata) for rdata in v6]))
                if suffix_wire is None or host.endswith(search_suffix):
                    continue
                expanded = host + search_suffix
                if expanded in lowered:
                    continue  # e.g. "productpage." + "ns1.svc.cluster.local" is already a real name
                target_wire = _wire(host)
                if target_wire is None or len(target_wire) + len(suffix_wire) > 256:
                    continue  # cannot be asked on the wire anyway
                all_hosts[expanded] = None
                cname[expanded] = (Record(expanded, TYPE_CNAME, TTL, target_wire), host)
                if expanded.startswith("*."):
                    wildcard_keys.append(expanded)

        if unparsable:
            log.warning(
                "name table: skipped %d unparsable IPs (first in host %r)", len(unparsable), unparsable[0]
            )

        # Resolve CNAMEs only now: a later entry may have replaced the records of an earlier one's
        # target (Istio leaves the winner of such clashes to map order).
        a: dict[str, Answer] = {}
        aaaa: dict[str, Answer] = {}
        for host in all_hosts:
            link = cname.get(host)
            if link is None:
                a[host] = name4.get(host, NODATA)
                aaaa[host] = name6.get(host, NODATA)
            else:
                cn, target = link
                found4, found6 = name4.get(target), name6.get(target)
                a[host] = Answer((cn, *found4.records)) if found4 is not None else NODATA
                aaaa[host] = Answer((cn, *found6.records)) if found6 is not None else NODATA
        wildcard_a: dict[str, _Wildcard] = {}
        wildcard_aaaa: dict[str, _Wildcard] = {}
        for key in wildcard_keys:
            link = cname.get(key)
            wildcard_cname = link[0] if link is not None else None
            target = link[1] if link is not None else key
            wildcard_a[key] = _Wildcard(wildcard_cname, name4.get(target, NODATA).records)
            wildcard_aaaa[key] = _Wildcard(wildcard_cname, name6.get(target, NODATA).records)

        debug_copy = nds_pb2.NameTable()
        debug_copy.CopyFrom(name_table)
        return cls(a, aaaa, wildcard_a, wildcard_aaaa, debug_copy, generated)

    def lookup(self, qname: str, qtype: int) -> Answer | None:
        """Local answer for a lower-case FQDN question, or None when it must be forwarded upstream.

        None covers unknown names and every qtype other than A/AAAA, even for known names.
        """
        if qtype == TYPE_A:
            exact, wildcards = self._a, self._wildcard_a
        elif qtype == TYPE_AAAA:
            exact, wildcards = self._aaaa, self._wildcard_aaaa
        else:
            return None
        answer = exact.get(qname)
        if answer is not None:
            return answer
        if not wildcards or "\\" in qname or not qname.isascii():
            # A label with an escaped dot or backslash, or non-ASCII bytes, is no mesh name: splitting the
            # presentation form on dots would match the wrong wildcard. Forwarded upstream instead.
            return None
        # Most specific wildcard first: a.b.w. tries *.b.w., then *.w.
        last = len(qname) - 1
        dot = qname.find(".")
        while 0 <= dot < last:
            wildcard = wildcards.get("*." + qname[dot + 1 :])
            if wildcard is not None:
                return wildcard.answer(qname)
            dot = qname.find(".", dot + 1)
        return None

    def __len__(self) -> int:
        return len(self._a)

    def __contains__(self, qname: object) -> bool:
        return qname in self._a

    def ndsz(self) -> dict[str, Any]:
        """The /debug/ndsz view: the pushed NameTable plus every generated alias not in it.

        Generated aliases are labelled ``registry: Kubernetes`` whatever their source, as Istio does;
        search-expanded CNAME names are not listed.
        """
        table: dict[str, dict[str, Any]] = {}
        for host, info in self._name_table.table.items():
            table[host] = _info_json(info.ips, info.registry, info.shortname, info.namespace, info.alt_hosts)
        shared: dict[tuple[str, ...], dict[str, Any]] = {}  # one object per entry, not per alias
        for host, ips in self._generated.items():
            if host not in self._name_table.table:
                entry = shared.get(ips)
                if entry is None:
                    entry = shared[ips] = _info_json(ips, KUBERNETES, "", "", ())
                table[host] = entry
        return {"table": dict(sorted(table.items()))} if table else {}


def _info_json(
    ips: Iterable[str], registry: str, shortname: str, namespace: str, alt_hosts: Iterable[str]
) -> dict[str, Any]:
    """NameInfo as protobuf JSON: camelCase keys, empty fields left out."""
    out: dict[str, Any] = {}
    if ips := list(ips):
        out["ips"] = ips
    if registry:
        out["registry"] = registry
    if shortname:
        out["shortname"] = shortname
    if namespace:
        out["namespace"] = namespace
    if alt_hosts := list(alt_hosts):
        out["altHosts"] = alt_hosts
    return out


def shuffle_by_ids(items: list[_T], next_id: Callable[[], int]) -> None:
    """In-place shuffle driven by 16-bit message IDs, step for step as miekg/dns does.

    Also orders the upstream nameservers per query.
    """
    n = len(items)
    if n < 2:
        return
    if n == 2:
        if next_id() % 2 == 0:
            items[0], items[1] = items[1], items[0]
        return
    j = 0
    while j < n * (next_id() % 4 + 1):
        q = next_id() % n
        p = next_id() % n
        if q == p:
            p = (p + 1) % n
        items[q], items[p] = items[p], items[q]
        j += 1


def round_robin(records: Sequence[Record], next_id: Callable[[], int]) -> list[Record]:
    """Reorder a section: CNAMEs, other types (both as given), then shuffled A/AAAA, then shuffled MX."""
    if len(records) < 2:
        return list(records)
    cnames: list[Record] = []
    others: list[Record] = []
    addresses: list[Record] = []
    mx: list[Record] = []
    for record in records:
        rtype = record.rtype
        if rtype in (TYPE_A, TYPE_AAAA):
            addresses.append(record)
        elif rtype == TYPE_CNAME:
            cnames.append(record)
        elif rtype == TYPE_MX:
            mx.append(record)
        else:
            others.append(record)
    shuffle_by_ids(addresses, next_id)
    shuffle_by_ids(mx, next_id)
    return cnames + others + addresses + mx


def random_id() -> int:
    """A random 16-bit value for round-robin.

    Not ``secrets``: reply order is not a secret, and the shuffle may draw dozens of values per
    reply on the hot path, where a system call per value would cost more than the lookup.
    """
    return random.getrandbits(16)
