"""A chained plugin's ``prevResult``: read in the caller's cniVersion, printed back in it.

istio-cni adds no interface or address: on success it hands the previous plugin's result on. The
runtime reads that result in the cniVersion of its config, so it is parsed in that version, held in
the 1.0.0 model (every version converts to and from it, as the CNI library does), and printed back
in the same version. Fields a version does not have are dropped, unknown fields too, exactly as a
Go plugin decoding into the library's structs would.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

_LEGACY = ("0.1.0", "0.2.0")
_V04 = ("0.3.0", "0.3.1", "0.4.0")
_INTERFACE_KEYS = {
    "1.0.0": ("name", "mac", "mtu", "sandbox", "socketPath", "pciID"),
    "0.4.0": ("name", "mac", "sandbox"),
}
_ROUTE_KEYS = ("dst", "gw", "mtu", "advmss", "priority", "table", "scope")
_DNS_KEYS = ("nameservers", "domain", "search", "options")


class ResultError(ValueError):
    """The previous result does not parse in the config's cniVersion."""


def _cidr(where: str, value: object) -> str:
    """An address with its prefix length, host bits kept (as the library's IPNet keeps them)."""
    if not isinstance(value, str) or "/" not in value:
        raise ResultError(f"{where}: expected a CIDR (address/bits), got {value!r}")
    try:
        return str(ipaddress.ip_interface(value))
    except ValueError:
        raise ResultError(f"{where}: invalid CIDR {value!r}") from None


def _ip(where: str, value: object) -> str:
    if not isinstance(value, str):
        raise ResultError(f"{where}: expected an IP address string, got {value!r}")
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ResultError(f"{where}: invalid IP address {value!r}") from None


def _object(where: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ResultError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _list(where: str, value: object) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ResultError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _string(where: str, value: object) -> str:
    if not isinstance(value, str):
        raise ResultError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def _strings(where: str, value: object) -> list[str]:
    return [_string(f"{where}[{i}]", item) for i, item in enumerate(_list(where, value))]


def _interface(where: str, raw: object, keys: tuple[str, ...]) -> dict[str, Any]:
    """An interface with ``keys`` (name first), typed as the library's struct (``mtu`` an integer,
    the rest strings): what is handed on as given must be what a Go plugin could have decoded."""
    given = _object(where, raw)
    name = given.get("name")
    interface: dict[str, Any] = {"name": "" if name is None else _string(f"{where}.name", name)}
    for key in keys[1:]:
        value = given.get(key)
        if value is None:
            continue
        if key == "mtu" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ResultError(f"{where}.mtu: expected an integer, got {value!r}")
        if key != "mtu":
            _string(f"{where}.{key}", value)
        if value not in ("", 0):
            interface[key] = value
    return interface


def _route(where: str, raw: object) -> dict[str, Any]:
    given = _object(where, raw)
    route: dict[str, Any] = {"dst": _cidr(f"{where}.dst", given.get("dst"))}
    if given.get("gw"):
        route["gw"] = _ip(f"{where}.gw", given["gw"])
    for key in _ROUTE_KEYS[2:]:
        value = given.get(key)
        # mtu, advmss, priority are omitted when zero; table and scope are pointers, kept when set
        if value is None or (value == 0 and key not in ("table", "scope")):
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ResultError(f"{where}.{key}: expected an integer, got {value!r}")
        route[key] = value
    return route


def _dns(raw: object) -> dict[str, Any]:
    given = _object("prevResult.dns", raw if raw is not None else {})
    dns: dict[str, Any] = {}
    for key in _DNS_KEYS:
        value = given.get(key)
        if value is None:
            continue
        where = f"prevResult.dns.{key}"
        value = _string(where, value) if key == "domain" else _strings(where, value)
        if value:
            dns[key] = value
    return dns


def _ip_config(where: str, raw: object) -> dict[str, Any]:
    given = _object(where, raw)
    config: dict[str, Any] = {}
    if given.get("interface") is not None:
        index = given["interface"]
        if not isinstance(index, int) or isinstance(index, bool):
            raise ResultError(f"{where}.interface: expected an integer, got {index!r}")
        config["interface"] = index
    config["address"] = _cidr(f"{where}.address", given.get("address"))
    if given.get("gateway"):
        config["gateway"] = _ip(f"{where}.gateway", given["gateway"])
    return config


def parse(raw: object, version: str) -> dict[str, Any]:
    """``prevResult`` as the 1.0.0 model (interfaces, ips, routes, dns); raises ResultError."""
    given = _object("prevResult", raw)
    model: dict[str, Any] = {"interfaces": [], "ips": [], "routes": [], "dns": _dns(given.get("dns"))}
    if version in _LEGACY:
        for key in ("ip4", "ip6"):
            if given.get(key) is None:
                continue
            legacy = _object(f"prevResult.{key}", given[key])
            ip: dict[str, Any] = {"address": _cidr(f"prevResult.{key}.ip", legacy.get("ip"))}
            if legacy.get("gateway"):
                ip["gateway"] = _ip(f"prevResult.{key}.gateway", legacy["gateway"])
            model["ips"].append(ip)
            routes = _list(f"prevResult.{key}.routes", legacy.get("routes"))
            model["routes"].extend(_route(f"prevResult.{key}.routes[{i}]", r) for i, r in enumerate(routes))
        return model
    keys = _INTERFACE_KEYS["0.4.0" if version in _V04 else "1.0.0"]
    interfaces = _list("prevResult.interfaces", given.get("interfaces"))
    model["interfaces"] = [
        _interface(f"prevResult.interfaces[{i}]", x, keys) for i, x in enumerate(interfaces)
    ]
    ips = _list("prevResult.ips", given.get("ips"))
    model["ips"] = [_ip_config(f"prevResult.ips[{i}]", ip) for i, ip in enumerate(ips)]
    routes = _list("prevResult.routes", given.get("routes"))
    model["routes"] = [_route(f"prevResult.routes[{i}]", r) for i, r in enumerate(routes)]
    return model


def _family(cidr: str) -> int:
    return ipaddress.ip_interface(cidr).version


def render(model: Mapping[str, Any], version: str) -> dict[str, Any]:
    """The 1.0.0 model as a result of ``version`` (key order as the library's structs marshal it)."""
    out: dict[str, Any] = {"cniVersion": version}
    if version in _LEGACY:
        for family, key in ((4, "ip4"), (6, "ip6")):
            ip = next((ip for ip in model["ips"] if _family(ip["address"]) == family), None)
            if ip is None:
                continue
            legacy: dict[str, Any] = {"ip": ip["address"]}
            if "gateway" in ip:
                legacy["gateway"] = ip["gateway"]
            routes = [r for r in model["routes"] if _family(r["dst"]) == family]
            if routes:
                legacy["routes"] = routes
            out[key] = legacy
        out["dns"] = dict(model["dns"])
        return out
    keys = _INTERFACE_KEYS["0.4.0" if version in _V04 else "1.0.0"]
    interfaces = [{k: i[k] for k in keys if k in i} for i in model["interfaces"]]
    if interfaces:
        out["interfaces"] = interfaces
    ips = []
    for ip in model["ips"]:
        if version in _V04:
            ip = {"version": str(_family(ip["address"])), **ip}
        ips.append(dict(ip))
    if ips:
        out["ips"] = ips
    if model["routes"]:
        out["routes"] = [dict(r) for r in model["routes"]]
    out["dns"] = dict(model["dns"])
    return out


def empty(version: str) -> dict[str, Any]:
    """What a plugin with no previous result answers: no interfaces, no addresses."""
    return {"cniVersion": version, "dns": {}}
