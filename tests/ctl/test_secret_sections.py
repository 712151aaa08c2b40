"""The secrets section of a config dump, found as every config-dump view finds a section (the last of
its type, istioctl's getSection), and its lists checked before use."""

from __future__ import annotations

from typing import Any

import pytest

from istio_agent.ctl import rootca, secrets

SECRETS = "type.googleapis.com/envoy.admin.v3.SecretsConfigDump"


def rootca_entry(inline: str) -> dict[str, Any]:
    return {"name": "ROOTCA", "secret": {"validation_context": {"trusted_ca": {"inline_bytes": inline}}}}


def test_the_last_secrets_section_is_used() -> None:
    dump = {
        "configs": [
            {"@type": SECRETS, "dynamic_active_secrets": [rootca_entry("Zmlyc3Q=")]},
            {"@type": SECRETS, "dynamic_active_secrets": [rootca_entry("bGFzdA==")]},
        ]
    }
    assert rootca.root_ca(dump) == b"last"
    assert secrets.secrets_dump(dump, "test")["dynamic_active_secrets"][0] == rootca_entry("bGFzdA==")


@pytest.mark.parametrize("value", [5, "x", {"a": 1}])
def test_a_secret_list_of_the_wrong_shape_is_an_error(value: Any) -> None:
    dump = {"configs": [{"@type": SECRETS, "dynamic_active_secrets": value}]}
    with pytest.raises(rootca.RootCAError, match="dynamic_active_secrets"):
        rootca.root_ca(dump)
    with pytest.raises(secrets.SecretsError, match="dynamic_active_secrets"):
        secrets.secrets_dump(dump, "test")
