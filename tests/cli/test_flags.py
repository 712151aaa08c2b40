"""``cli/flags.py``: Go's pflag forms (as cobra parses Istio's commands) on argparse.

pflag accepts ``--flag=value`` and ``--flag value``, ``-f value``, ``-fvalue`` and ``-f=value``,
clusters of short booleans (``-nk eth1``), booleans with a value only after ``=`` (``--dry-run=false``),
and, for commands that whitelist unknown flags (``pilot-agent proxy``), skips an unknown flag and the
value after it (spf13/pflag flag.go, ``stripUnknownFlagValue``).
"""

from __future__ import annotations

import pytest

from istio_agent.cli.flags import Flag, FlagError, FlagSet

FLAGS = FlagSet(
    "pilot-agent test",
    "A command for the tests.",
    (
        Flag("domain", help="DNS domain suffix"),
        Flag("meshConfig", default="./etc/istio/config/mesh", help="mesh config file"),
        Flag("envoy-port", "p", help="port"),
        Flag("kube-virt-interfaces", "k", help="interfaces"),
        Flag("dry-run", "n", boolean=True, help="print the rules"),
        Flag("log_as_json", boolean=True, help=None),
        Flag("log_target", repeated=True, default=("stdout",), help=None),
    ),
)


def test_defaults() -> None:
    parsed = FLAGS.parse([])
    assert parsed.values == {
        "domain": None,
        "meshConfig": "./etc/istio/config/mesh",
        "envoy-port": None,
        "kube-virt-interfaces": None,
        "dry-run": None,
        "log_as_json": None,
        "log_target": ("stdout",),
    }
    assert parsed.args == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--domain=a.b", "-p=15001"],
        ["--domain", "a.b", "-p", "15001"],
        ["--domain", "a.b", "-p15001"],
        ["-p", "15001", "--domain=a.b"],
    ],
)
def test_value_forms(argv: list[str]) -> None:
    parsed = FLAGS.parse(argv)
    assert (parsed["domain"], parsed["envoy-port"]) == ("a.b", "15001")


def test_a_value_may_start_with_a_dash_or_be_empty() -> None:
    """pflag takes the next argument as the value whatever it is; argparse alone would refuse ``-1``."""
    parsed = FLAGS.parse(["--domain", "-x", "-k", ""])
    assert (parsed["domain"], parsed["kube-virt-interfaces"]) == ("-x", "")


@pytest.mark.parametrize(
    ("argv", "value"),
    [
        (["--dry-run"], True),
        (["-n"], True),
        (["--dry-run=false"], False),
        (["-n=false"], False),
        (["--dry-run=0"], False),
        (["--dry-run=T"], True),
        ([], None),
    ],
)
def test_booleans_take_a_value_only_after_equals(argv: list[str], value: bool | None) -> None:
    assert FLAGS.parse(argv)["dry-run"] is value


def test_a_boolean_does_not_take_the_next_argument() -> None:
    parsed = FLAGS.parse(["--log_as_json", "sidecar"])
    assert parsed["log_as_json"] is True
    assert parsed.args == ["sidecar"]


def test_short_clusters() -> None:
    parsed = FLAGS.parse(["-nk", "eth1"])
    assert (parsed["dry-run"], parsed["kube-virt-interfaces"]) == (True, "eth1")
    assert FLAGS.parse(["-nketh2"])["kube-virt-interfaces"] == "eth2"


def test_repeated_flags_collect_in_order() -> None:
    assert FLAGS.parse(["--log_target=a", "--log_target", "b"])["log_target"] == ("a", "b")


def test_positionals_interleave_and_double_dash_ends_the_flags() -> None:
    parsed = FLAGS.parse(["GET", "--domain=x", "stats", "--", "--dry-run", "-n"])
    assert parsed.args == ["GET", "stats", "--dry-run", "-n"]
    assert parsed["dry-run"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus"], "No such option '--bogus'."),
        (["--bogus=1"], "No such option '--bogus'."),
        (["-z"], "No such option '-z'."),
        (["-nz"], "No such option '-z'."),
        (["--domain"], "Option '--domain' requires an argument."),
        (["-p"], "Option '-p' requires an argument."),
        (
            ["--dry-run=maybe"],
            "invalid value for --dry-run: invalid boolean 'maybe' (expected true or false)",
        ),
        (["--dom=x"], "No such option '--dom'."),  # no abbreviations: pflag has none
    ],
)
def test_errors(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError) as caught:
        FLAGS.parse(argv)
    assert str(caught.value) == message


def test_unknown_flags_are_skipped_as_pflag_skips_them_when_whitelisted() -> None:
    """``--x value`` drops the value too; ``--x=value`` and ``--x --next`` drop only the flag."""
    parsed = FLAGS.parse(
        ["--someFutureFlag", "router", "--other=1", "--gone", "--domain=d", "-z", "v", "sidecar"],
        tolerant=True,
    )
    assert parsed.args == ["sidecar"]
    assert parsed["domain"] == "d"


def test_help_lists_visible_flags_only() -> None:
    text = FLAGS.help()
    assert text.startswith("usage: pilot-agent test [flags]\n\nA command for the tests.")
    assert "-n, --dry-run" in text and "print the rules" in text
    assert "--domain string" in text
    assert "log_as_json" not in text and "log_target" not in text


def test_help_flag_is_reported() -> None:
    assert FLAGS.parse(["--domain=x", "-h"]).help
    assert FLAGS.parse(["--help"]).help
    assert not FLAGS.parse(["--", "--help"]).help
