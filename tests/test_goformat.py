"""Go's renderings of exit statuses, gRPC codes and durations, as Istio's messages show them."""

from __future__ import annotations

import signal
from datetime import timedelta

import grpc
import pytest

from istio_agent import goformat


def test_exit_text() -> None:
    assert goformat.exit_text(0) == "exit status 0"
    assert goformat.exit_text(1) == "exit status 1"
    assert goformat.exit_text(-signal.SIGKILL) == "signal: killed"
    assert goformat.exit_text(-signal.SIGTERM) == "signal: terminated"
    assert goformat.exit_text(-signal.SIGSEGV) == "signal: segmentation fault"


def test_status_code_names() -> None:
    assert goformat.status_code_name(grpc.StatusCode.RESOURCE_EXHAUSTED) == "ResourceExhausted"
    assert goformat.status_code_name(grpc.StatusCode.CANCELLED) == "Canceled"
    assert goformat.status_code_name(grpc.StatusCode.DEADLINE_EXCEEDED) == "DeadlineExceeded"
    assert goformat.status_code_name(grpc.StatusCode.OK) == "OK"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.1, "100ms"),
        (0.1054321, "105.432ms"),
        (0.5, "500ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (30, "30s"),
        (90, "1m30s"),
        (3600, "1h0m0s"),
        (-1.5, "-1.5s"),
        (timedelta(milliseconds=2**31 - 1), "596h31m23.647s"),
        (timedelta(hours=24), "24h0m0s"),
    ],
)
def test_durations(seconds: float | timedelta, text: str) -> None:
    assert goformat.duration(seconds) == text


def test_tabwrite_aligns_column_blocks_as_go() -> None:
    # Go: tabwriter.NewWriter(w, 0, 8, 2, ' ', 0) fed "a\tbb\tc\n", "ccc\td\n", "e\tf\tg\th\n"
    lines = [["a", "bb", "c"], ["ccc", "d"], ["e", "f", "g", "h"]]
    assert goformat.tabwrite(lines, padding=2) == "a    bb  c\nccc  d\ne    f  g  h\n"


def test_tabwrite_pads_empty_cells_and_keeps_the_trailing_padding_go_writes() -> None:
    # istioctl's golden (writer/envoy/configdump/testdata/secret/istio/output): a WARMING secret's
    # row ends in the padding of its VALID CERT cell, its last cells being empty
    lines = [["NAME", "TYPE", "STATE", "LAST"], ["x", "", "WARMING", ""], ["longer", "CA", "ACTIVE", "z"]]
    assert goformat.tabwrite(lines, padding=5) == (
        "NAME       TYPE     STATE       LAST\nx                   WARMING     \nlonger     CA       ACTIVE      z\n"
    )
    assert goformat.tabwrite([]) == ""


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("istioctl~0.0.0.0~a.b~b.svc", '"istioctl~0.0.0.0~a.b~b.svc"'),
        ('say "hi"\\', '"say \\"hi\\"\\\\"'),
        ("tab\tnew\nbell\a\x00\x7f", '"tab\\tnew\\nbell\\a\\x00\\x7f"'),
        ("café ✓", '"café ✓"'),
        ("\u200b\U000e0001", '"\\u200b\\U000e0001"'),
    ],
)
def test_go_quote_is_strconv_quote(text: str, quoted: str) -> None:
    assert goformat.go_quote(text) == quoted
