"""``agentctl proxy-config log``: read and set Envoy's logger levels through its admin ``/logging``.

The rules are istioctl 1.28's ``logCmd`` (``istioctl/pkg/proxyconfig/proxyconfig.go``):

* Envoy is asked for its loggers first (a POST to ``/logging`` without parameters changes nothing
  and answers the listing); a logger name given to ``--level`` must occur in that listing text (a
  substring test, so ``htt`` passes here and is then refused by Envoy) or be ``level``;
* ``--level`` is ``[<logger>:]<level>,...`` (``=`` works as ``:``; anything up to a ``::`` is
  dropped); a bare level means every logger and replaces what came before it in the list;
* the level for every logger is sent first, then one request per named logger; the answer to the
  last request (Envoy's listing after the change) is printed under the target's name;
* ``--reset`` sets every logger to ``warning``, istioctl's default when the injector's ConfigMap
  names no proxy log level (there is no ConfigMap to read here).

Where istioctl is non-deterministic (Go map order) we keep the order given; where it keeps going
after a failed request and reports only the last one, we stop at the first failure.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from istio_agent.ctl.configdump.source import DEFAULT_ADMIN

LEVELS = ("trace", "debug", "info", "warning", "error", "critical", "off")
"""Envoy's levels, in istioctl's order (its help text lists them so)."""
LEVEL_NAMES = {**{level: level for level in LEVELS}, "warn": "warning"}
ALL_LOGGERS = "level"
"""The pseudo logger name that sets every logger (Envoy's ``/logging?level=``)."""
RESET_LEVEL = "warning"
_NAME_LEVEL = re.compile(r"[:=]")


class LogLevelError(Exception):
    """The command cannot be done as asked; the message is istioctl's where istioctl has one."""


@dataclass(frozen=True)
class LogQuery:
    """What the operator asked: the Envoy admin address and the flags."""

    address: str = DEFAULT_ADMIN
    level: str = ""
    reset: bool = False
    output: str = "short"
    timeout: float = 5.0


def check(query: LogQuery) -> None:
    """istioctl's flag checks, made before Envoy is asked anything."""
    if query.reset and query.level:
        raise LogLevelError("--level cannot be combined with --reset")
    if query.output not in ("", "short"):
        raise LogLevelError("--output is not applicable for this command")


def parse_levels(spec: str, active: str) -> dict[str, str]:
    """``--level`` as {logger: level}; ``active`` is Envoy's listing, against which names are checked."""
    levels: dict[str, str] = {}
    for item in spec.split(","):
        if ":" not in item and "=" not in item:
            if item not in LEVEL_NAMES:
                raise LogLevelError(f"unrecognized logging level: {item}")
            levels = {ALL_LOGGERS: LEVEL_NAMES[item]}
            continue
        parts = _NAME_LEVEL.split(item.split("::")[-1], maxsplit=1)
        if len(parts) < 2:
            raise LogLevelError(f"unrecognized logging level: (none after the logger in {item})")
        name, level = parts
        if name not in active and name != ALL_LOGGERS:
            raise LogLevelError(f"unrecognized logger name: {name}")
        if level not in LEVEL_NAMES:
            raise LogLevelError(f"unrecognized logging level: {level}")
        levels[name] = LEVEL_NAMES[level]
    return levels


def reset_levels() -> dict[str, str]:
    return {ALL_LOGGERS: RESET_LEVEL}


def updates(levels: dict[str, str]) -> list[str]:
    """The ``/logging`` query strings to send, the level for every logger first."""
    first = [f"{ALL_LOGGERS}={levels[ALL_LOGGERS]}"] if ALL_LOGGERS in levels else []
    return first + [f"{name}={level}" for name, level in levels.items() if name != ALL_LOGGERS]


async def post_logging(address: str, query: str, timeout: float) -> str:
    """POST ``/logging[?query]``; Envoy's answer, or istioctl's error for a failure or a non-200."""
    from istio_agent.ctl.configdump.source import ConfigDumpError, get

    try:
        status, body = await get(address, "/logging" + (f"?{query}" if query else ""), timeout, method="POST")
    except ConfigDumpError as err:
        raise LogLevelError(f"failed to execute command on Envoy: {err}") from None
    if status != 200:
        raise LogLevelError(f"failed to execute command on Envoy: unexpected status code: {status}")
    return body.decode(errors="replace")


def _configuring(address: str, err: LogLevelError) -> LogLevelError:
    """istioctl's error for a failed change: one pod's error in hashicorp/go-multierror's list."""
    return LogLevelError(f"1 error occurred:\n\t* error configuring log level for {address}: {err}\n\n")


async def run(query: LogQuery, out: Callable[[str], None]) -> None:
    """List Envoy's loggers, change them as asked, and print Envoy's last answer under the address."""
    check(query)
    answer = await post_logging(query.address, "", query.timeout)
    if query.reset:
        levels = reset_levels()
    elif query.level:
        levels = parse_levels(query.level, answer)
    else:
        levels = {}
    try:
        for update in updates(levels):
            answer = await post_logging(query.address, update, query.timeout)
    except LogLevelError as err:
        raise _configuring(query.address, err) from None
    out(f"{query.address}:\n{answer}")
