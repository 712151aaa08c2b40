"""The flow of ``agentctl proxy-config secret``: read Envoy's secrets, check them, compare, print.

Output goes to ``out`` (what scripts parse: istioctl's formats); notes about invalid certificates
and mismatches go to ``err``, so they are seen without changing what a script reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from istio_agent.ctl import secrets, secretsview
from istio_agent.ctl.configdump.source import DEFAULT_ADMIN

OUTPUTS = ("short", "json", "yaml", "items")


@dataclass(frozen=True)
class SecretQuery:
    """What the operator asked: an admin address or a dump file, the format, and whether to compare."""

    address: str = DEFAULT_ADMIN
    file: str | None = None
    output: str = "short"
    verbose: bool = False
    diff: bool = False
    agent: str = secrets.DEFAULT_AGENT
    timeout: float = 5.0


def resolve_target(target: str | None, file: str | None) -> tuple[str, str | None]:
    """(admin address, dump file): ``-f`` as istioctl; a positional that names a file is a file too."""
    if file is not None and target is not None:
        raise secrets.SecretsError("give either an admin address or -f FILE, not both")
    if file is not None:
        return DEFAULT_ADMIN, file
    if target is not None and os.path.isfile(target):
        return DEFAULT_ADMIN, target
    return target or DEFAULT_ADMIN, None


async def run(
    query: SecretQuery,
    out: Callable[[str], None],
    err: Callable[[str], None],
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> None:
    """Print the summary, the dump, or the comparison; raise SecretsError when a source fails."""
    if query.file is not None:
        dump, source = secrets.read_dump_file(query.file), query.file
    else:
        dump, source = await secrets.fetch_dump(query.address, query.timeout), query.address
    section = secrets.secrets_dump(dump, source)
    moment = now()
    items = secrets.envoy_items(section, moment)
    if query.diff:
        view = await secrets.fetch_agent_view(query.agent, query.timeout)
        rows = secrets.diff(items, secrets.agent_items(view, query.agent, moment))
        checks = secrets.check_files(view, items)
        if query.output in ("json", "items"):
            out(secretsview.go_json(secretsview.diff_document(rows, checks)))
        elif query.output == "yaml":
            out(secretsview.document_yaml(secretsview.diff_document(rows, checks)).rstrip("\n"))
        else:
            out(secretsview.diff_table(rows, now=moment, verbose=query.verbose).rstrip("\n"))
            files = secretsview.files_table(checks)
            if files:
                out("")
                out(files.rstrip("\n"))
        _notes(err, items)
        for line in secrets.mismatches(rows):
            err(f"MISMATCH {line}")
        for check in checks:
            if check.envoy in ("DIFFERENT", "ERROR"):
                detail = (
                    f": {check.error}"
                    if check.error
                    else f" from what Envoy loaded for {check.resource_name}"
                )
                err(f"MISMATCH file {check.path} {check.envoy.lower()}{detail}")
        return
    if query.output in ("json", "yaml"):  # istioctl prints the dump as it is, empty or not
        text = secretsview.dump_json(section) if query.output == "json" else secretsview.dump_yaml(section)
        out(text.rstrip("\n"))
        return
    if query.output == "items":
        out(secretsview.items_json(items))
    elif not secrets.has_active_or_warming(section):  # istioctl's PrintSecretSummary
        out(secretsview.NO_DYNAMIC.rstrip("\n"))
        return
    else:
        out(secretsview.summary_table(items, now=moment, verbose=query.verbose).rstrip("\n"))
    _notes(err, items)


def _notes(err: Callable[[str], None], items: list[secrets.SecretItem]) -> None:
    for item in items:
        for problem in item.problems:
            err(f"{item.name} ({item.state.lower()}): {problem}")
