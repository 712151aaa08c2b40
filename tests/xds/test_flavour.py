"""Small helpers of xds.flavour that every response relies on."""

from __future__ import annotations

import uuid

from istio_agent.xds.flavour import new_nonce


def test_nonce_is_a_random_version_4_uuid_in_its_text_form() -> None:
    nonces = {new_nonce() for _ in range(1000)}
    assert len(nonces) == 1000
    for nonce in nonces:
        parsed = uuid.UUID(nonce)
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
        assert str(parsed) == nonce
