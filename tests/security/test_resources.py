from __future__ import annotations

import pytest

from istio_agent.security.resources import FileResource, is_root_resource_name, parse_file_resource


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("file-cert:cert~key", FileResource(cert_path="cert", key_path="key")),
        ("file-cert:/etc/c.pem~/etc/k.pem", FileResource(cert_path="/etc/c.pem", key_path="/etc/k.pem")),
        ("file-root:root", FileResource(ca_path="root")),
        ("file-root:/etc/ssl/root.pem", FileResource(ca_path="/etc/ssl/root.pem")),
        ("file-root:system", FileResource(ca_path="system")),
        ("file:root", None),
        ("default", None),
        ("ROOTCA", None),
        ("", None),
        ("file-certs:a~b", None),
    ],
)
def test_parse(name: str, expected: FileResource | None) -> None:
    assert parse_file_resource(name) == expected


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("file-root:", "empty root certificate path"),
        ("file-root:root~extra", "takes a single path"),
        ("file-root:~", "takes a single path"),
        ("file-cert:", "found 0"),
        ("file-cert:onlycert", "found 0"),
        ("file-cert:a~b~c", "found 2"),
        ("file-cert:~key", "empty certificate path"),
        ("file-cert:cert~", "empty key path"),
        ("file-cert:~", "empty certificate path"),
    ],
)
def test_parse_errors(name: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as info:
        parse_file_resource(name)
    assert repr(name) in str(info.value)


@pytest.mark.parametrize(
    ("resource", "name", "is_key_cert", "is_root"),
    [
        (FileResource(cert_path="c", key_path="k"), "file-cert:c~k", True, False),
        (FileResource(ca_path="p"), "file-root:p", False, True),
        (FileResource(cert_path="c"), "", False, False),
        (FileResource(key_path="k"), "", False, False),
        (FileResource(), "", False, False),
    ],
)
def test_resource_name(resource: FileResource, name: str, is_key_cert: bool, is_root: bool) -> None:
    assert resource.resource_name == name
    assert resource.is_key_cert is is_key_cert
    assert resource.is_root is is_root
    if name:
        assert parse_file_resource(name) == resource


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("ROOTCA", True),
        ("file-root:/a/root.pem", True),
        ("file-root:system", True),
        ("default", False),
        ("file-cert:c~k", False),
        ("rootca", False),
        ("file:root", False),
    ],
)
def test_is_root_resource_name(name: str, expected: bool) -> None:
    assert is_root_resource_name(name) is expected
