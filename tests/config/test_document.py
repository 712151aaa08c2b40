"""The one document reader: how each decoder matches keys, and errors that name the field."""

from __future__ import annotations

from datetime import timedelta

import pytest

from istio_agent.config import ConfigError
from istio_agent.config.document import DocumentSyntaxError, Keys, Node, config_errors, load_document


def root(value: object) -> Node:
    return Node(value, "doc", config_errors("SOURCE: "))


def test_protojson_takes_json_and_proto_names_and_refuses_the_rest() -> None:
    fields = root({"periodSeconds": 1, "initial_delay_seconds": 2}).fields(
        ("periodSeconds", "initialDelaySeconds"), Keys.PROTOJSON
    )
    assert fields["periodSeconds"].value == 1 and fields["initialDelaySeconds"].value == 2
    assert fields["initialDelaySeconds"].where == "doc.initialDelaySeconds"
    with pytest.raises(ConfigError, match=r"^SOURCE: doc\.bogus: unknown field$"):
        root({"bogus": 1}).fields(("periodSeconds",), Keys.PROTOJSON)
    with pytest.raises(
        ConfigError, match=r"doc\.periodSeconds: set twice \(as periodSeconds and period_seconds\)"
    ):
        root({"periodSeconds": 1, "period_seconds": 2}).fields(("periodSeconds",), Keys.PROTOJSON)


def test_lenient_protojson_ignores_unknown_keys() -> None:
    fields = root({"meshId": "m", "gatewayTopology": {}}).fields(("meshId",), Keys.PROTOJSON_LENIENT)
    assert fields.given() == ["meshId"]


def test_go_json_matches_keys_case_insensitively_last_one_winning() -> None:
    fields = root({"PORT": "1", "port": "2", "extra": 3}).fields(("port", "path"), Keys.GO_JSON)
    assert fields["port"].value == "2"
    assert "path" not in fields and fields["path"].is_null and fields["path"].where == "doc.path"


def test_exact_keys_list_the_unknown_ones() -> None:
    with pytest.raises(ConfigError, match=r'doc: unknown keys "x", "y" \(known: name, port\)'):
        root({"y": 1, "x": 2, "name": "a"}).fields(("name", "port"), Keys.EXACT)


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (None, "null"),
        (True, "a boolean"),
        (1.5, "a number"),
        ("7", "a string"),
        ([], "a list"),
        ({}, "a map"),
    ],
)
def test_type_errors_say_what_was_found(value: object, kind: str) -> None:
    with pytest.raises(ConfigError, match=f"^SOURCE: doc: expected an integer, got {kind}$"):
        root(value).integer()


def test_lenient_integers_are_protojsons() -> None:
    assert root("7").integer(lenient=True) == 7
    assert root(7.0).integer(lenient=True) == 7
    with pytest.raises(ConfigError, match="expected an integer, got a number"):
        root(7.5).integer(lenient=True)
    with pytest.raises(ConfigError, match="must be between 1 and 65535, got 0"):
        root(0).port()
    with pytest.raises(ConfigError, match="doc: required"):
        root(None).port()


def test_lenient_integers_take_ascii_digits_only() -> None:
    with pytest.raises(ConfigError, match="expected an integer, got a string"):
        root("\u00b2").integer(lenient=True)  # str.isdigit() says yes; int() raised ValueError


def test_numbers_are_finite_and_bounded() -> None:
    assert root(50).number(minimum=0, maximum=100) == 50.0
    with pytest.raises(ConfigError, match=r"^SOURCE: doc: must be between 0 and 100, got 101$"):
        root(101).number(minimum=0, maximum=100)
    with pytest.raises(ConfigError, match="must be a finite number"):
        root(float("nan")).number()
    with pytest.raises(ConfigError, match="must be a finite number"):
        root(10**400).number()


def test_durations_are_go_durations_within_bounds() -> None:
    assert root("1.500s").duration() == timedelta(seconds=1.5)
    assert root(2).duration() == timedelta(seconds=2)
    for value in ("99999999999h", 1e300, float("inf"), 10**400):
        with pytest.raises(ConfigError, match=r"^SOURCE: doc: time: invalid duration"):
            root(value).duration()
    with pytest.raises(ConfigError, match=r"^SOURCE: doc: must be at most 24h0m0s, got 25h0m0s$"):
        root("25h").duration(maximum=timedelta(hours=24))
    with pytest.raises(ConfigError, match="expected a duration such as 5s, got a boolean"):
        root(True).duration()


def test_lists_maps_and_choices() -> None:
    assert root(None).items() == []
    assert root(["a", "b"]).strings() == ("a", "b")
    with pytest.raises(ConfigError, match=r"doc\[1\]: expected a string, got an integer"):
        root(["a", 1]).strings()
    assert root({"a": 1, "b": True}).string_map() == {"a": "1", "b": "true"}
    with pytest.raises(ConfigError, match=r"doc\.a: expected a string, got a list"):
        root({"a": []}).string_map()
    assert root("HTTPS").choice(("http", "https"), fold=str.lower) == "https"
    with pytest.raises(ConfigError, match="must be one of http, https, got 'ftp'"):
        root("ftp").choice(("http", "https"))


def test_a_document_without_a_path_names_only_the_source() -> None:
    with pytest.raises(ConfigError, match=r"^SOURCE: expected a map, got a list$"):
        Node([], "", config_errors("SOURCE: ")).fields((), Keys.EXACT)


def test_keys_that_are_not_words_are_quoted_in_the_path() -> None:
    labels = root({"app.kubernetes.io/name": 1})
    with pytest.raises(ConfigError, match=r'doc\["app\.kubernetes\.io/name"\]: expected a string'):
        labels.child("app.kubernetes.io/name", 1).text()


def test_documents_are_json_or_yaml() -> None:
    assert load_document('{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}
    assert load_document("a:\n  - 1\n  - b\n") == {"a": [1, "b"]}
    assert load_document("") is None
    with pytest.raises(DocumentSyntaxError, match="line 1"):
        load_document("{unclosed")
