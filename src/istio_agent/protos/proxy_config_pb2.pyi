from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ProxyConfig(_message.Message):
    __slots__ = ("ca_certificates_pem",)
    CA_CERTIFICATES_PEM_FIELD_NUMBER: _ClassVar[int]
    ca_certificates_pem: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ca_certificates_pem: _Optional[_Iterable[str]] = ...) -> None: ...
