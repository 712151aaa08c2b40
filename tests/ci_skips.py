"""Under ``CI=true`` a test may not skip for want of what CI provides: root, a Debian tool, overlayfs.

CI runs the suite as root with the Debian packages ``make`` installs (README, ``.ci/run``). A test
that skips there for want of them tests nothing while the run stays green, so such a skip fails the
test instead, naming the want and the reason. Other skips stay skips, their reasons printed by
``.ci/run`` (``-rs``): a test that needs what root cannot be (a non-root user), or what the machine's
network happens to offer (IPv6, a free fixed port).

The suite says why it skips in words (``pytest.skip``, ``skipif`` reasons, ``CANNOT_RUN``), so a want
is recognised by the words the suite uses for it (:data:`WANTS`); ``tests/test_ci_skips.py`` pins
the reasons the suite gives today.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import pytest

WANTS = {
    "root": re.compile(r"\bneeds? root\b|\brun as root\b|\bCI runs as root\b", re.IGNORECASE),
    "a Debian tool": re.compile(
        r"\bnot installed\b|\bapt-get install\b|`make` installs|\bDebian's\b|\bis not usable here\b"
        r"|\((?:util-linux|iproute2)\b|\breinstall the package\b",
        re.IGNORECASE,
    ),
    "overlayfs": re.compile(r"\boverlayfs\b", re.IGNORECASE),
}
"""What CI provides, and the words a skip reason uses when it is missing."""


def in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    """``CI=true`` (or ``1``), as CI services and ``.ci/run`` set it."""
    return environ.get("CI", "").lower() in ("true", "1")


def unmet_want(reason: str) -> str | None:
    """Which of CI's provisions (root, a Debian tool, overlayfs) a skip reason says is missing."""
    for want, words in WANTS.items():
        if words.search(reason):
            return want
    return None


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str | None:
    """The reason of a skipped report (not an xfail), else None."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def fail_unmet_want(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Under CI, turn a skip for want of what CI provides into a failure that says so."""
    reason = skip_reason(report)
    if reason is None or not in_ci():
        return
    want = unmet_want(reason)
    if want is not None:
        report.outcome = "failed"
        report.longrepr = f"CI=true: this test skipped for want of {want}, which CI must provide: {reason}"
