"""Token sources: file re-read on every call, failures raised to the caller, the fetcher factory."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from istio_agent.config import ConfigError, SecuritySettings
from istio_agent.istiod.tokens import (
    FileTokenSource,
    StaticTokenSource,
    token_source_for,
)


def test_file_token_is_reread_and_stripped(tmp_path: Path) -> None:
    path = tmp_path / "istio-token"
    path.write_text("  first-token\n")
    source = FileTokenSource(path)
    assert source.token() == "first-token"
    path.write_text("second-token\n\n")
    assert source.token() == "second-token"


def test_unreadable_token_file_raises_and_logs_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The source is shared by the CA client and the xDS proxy: each logs the problem in its own
    scope (tests/istiod/test_dial.py), so the source itself stays quiet."""
    caplog.set_level(logging.DEBUG, logger="istio")
    path = tmp_path / "istio-token"
    with pytest.raises(FileNotFoundError):
        FileTokenSource(path).token()
    path.mkdir()
    with pytest.raises(IsADirectoryError):
        FileTokenSource(path).token()
    assert caplog.records == []


def test_undecodable_token_file_gives_a_token_no_header_can_carry(tmp_path: Path) -> None:
    path = tmp_path / "istio-token"
    path.write_bytes(b"\xff\xfe\x00bad")
    assert FileTokenSource(path).token() == "\ufffd\ufffd\x00bad"


def test_static_token_hides_its_value() -> None:
    source = StaticTokenSource("test_token")
    assert source.token() == "test_token"
    assert "test_token" not in repr(source)


@pytest.mark.parametrize("fetcher", ["JWT", ""])
@pytest.mark.parametrize("policy", ["third-party-jwt", "first-party-jwt"])
def test_jwt_fetcher_reads_the_projected_token(tmp_path: Path, fetcher: str, policy: str) -> None:
    settings = SecuritySettings(workdir=tmp_path, credential_fetcher_type=fetcher, jwt_policy=policy)
    source = token_source_for(settings)
    assert isinstance(source, FileTokenSource)
    assert source.path == tmp_path / "var/run/secrets/tokens/istio-token"
    source.path.parent.mkdir(parents=True)
    source.path.write_text("jwt\n")
    assert source.token() == "jwt"


def test_other_jwt_policy_means_no_token(tmp_path: Path) -> None:
    assert token_source_for(SecuritySettings(workdir=tmp_path, jwt_policy="none")) is None


def test_mock_fetcher_gives_test_token(tmp_path: Path) -> None:
    source = token_source_for(SecuritySettings(workdir=tmp_path, credential_fetcher_type="Mock"))
    assert source is not None
    assert source.token() == "test_token"


def test_unknown_fetcher_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid credential fetcher type foo"):
        token_source_for(SecuritySettings(workdir=tmp_path, credential_fetcher_type="foo"))
