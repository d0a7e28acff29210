from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class EnrollRequest(_message.Message):
    __slots__ = ("token", "csr_pem", "name")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    token: str
    csr_pem: bytes
    name: str
    def __init__(self, token: _Optional[str] = ..., csr_pem: _Optional[bytes] = ..., name: _Optional[str] = ...) -> None: ...

class RenewCertificateRequest(_message.Message):
    __slots__ = ("csr_pem",)
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    csr_pem: bytes
    def __init__(self, csr_pem: _Optional[bytes] = ...) -> None: ...

class EnrollResponse(_message.Message):
    __slots__ = ("certificate_pem", "ca_pem", "principal", "role", "expires_ms")
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: bytes
    ca_pem: bytes
    principal: str
    role: str
    expires_ms: int
    def __init__(self, certificate_pem: _Optional[bytes] = ..., ca_pem: _Optional[bytes] = ..., principal: _Optional[str] = ..., role: _Optional[str] = ..., expires_ms: _Optional[int] = ...) -> None: ...
