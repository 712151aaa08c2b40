"""End to end: a short soak (``bench/soak.py`` in under a minute) — faults, rotations, steady traffic.

The demo mesh with 14 s certificates (a rotation every 7 s), a request every 50 ms from ``a`` to
``b``, the control plane SIGKILLed and restarted, and one CA outage of 9 s that starts right
after both workloads rotated, so both next rotations must be retried after it (the certificates
outlive the outage). Nothing may fail, nothing
may grow, and the only warnings are those the faults explain.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import GOAL_FD_GROWTH, GOAL_RSS_GROWTH_MB, Plan, print_report, run_soak

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_short_soak_loses_no_request_and_keeps_rotating(short_tmp: Path) -> None:
    plan = Plan(duration=36, secret_ttl=14, request_interval=0.05, kill_every=12, outage=9)
    lines: list[str] = []
    report = run_soak(plan, short_tmp, say=lines.append)  # short: Unix socket paths
    print_report(plan, report, say=lines.append)
    shown = "\n".join(lines)

    assert report.kills >= 1 and report.outages, shown
    assert report.requests > 500, shown
    assert report.failed == [], shown
    # 36 s of 14 s certificates: at least three rotations each, one of them after the outage.
    assert report.rotations["a"] >= 3 and report.rotations["b"] >= 3, shown
    assert report.unexpected == [], shown
    for name in ("a", "b"):
        rss, fds = report.growth(name)
        assert rss <= GOAL_RSS_GROWTH_MB and fds <= GOAL_FD_GROWTH, shown
