from epochmesh.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RingChunk(_message.Message):
    __slots__ = ("job_id", "round", "attempt", "from_node_id", "phase", "step", "segment", "spec", "chunk", "last", "segment_digest", "owner_signature", "owner_certificate")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    OWNER_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    OWNER_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    attempt: int
    from_node_id: str
    phase: str
    step: int
    segment: int
    spec: _common_pb2.TensorSpec
    chunk: _common_pb2.DataChunk
    last: bool
    segment_digest: bytes
    owner_signature: bytes
    owner_certificate: bytes
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., from_node_id: _Optional[str] = ..., phase: _Optional[str] = ..., step: _Optional[int] = ..., segment: _Optional[int] = ..., spec: _Optional[_Union[_common_pb2.TensorSpec, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.DataChunk, _Mapping]] = ..., last: _Optional[bool] = ..., segment_digest: _Optional[bytes] = ..., owner_signature: _Optional[bytes] = ..., owner_certificate: _Optional[bytes] = ...) -> None: ...

class RingAck(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...

class OpenBulkRequest(_message.Message):
    __slots__ = ("job_id", "round", "attempt", "from_node_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    attempt: int
    from_node_id: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., from_node_id: _Optional[str] = ...) -> None: ...

class OpenBulkResponse(_message.Message):
    __slots__ = ("port", "token", "expires_in_s", "keep_alive")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    port: int
    token: bytes
    expires_in_s: float
    keep_alive: bool
    def __init__(self, port: _Optional[int] = ..., token: _Optional[bytes] = ..., expires_in_s: _Optional[float] = ..., keep_alive: _Optional[bool] = ...) -> None: ...

class TransferStateRequest(_message.Message):
    __slots__ = ("job_id", "node_id", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    version: int
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class TransferStateHeader(_message.Message):
    __slots__ = ("job_id", "version", "bundle")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    bundle: _common_pb2.TensorBundle
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., bundle: _Optional[_Union[_common_pb2.TensorBundle, _Mapping]] = ...) -> None: ...

class TransferStateResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: TransferStateHeader
    chunk: _common_pb2.DataChunk
    def __init__(self, header: _Optional[_Union[TransferStateHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.DataChunk, _Mapping]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("payload", "from_node_id", "job_id", "round", "attempt")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    from_node_id: str
    job_id: str
    round: int
    attempt: int
    def __init__(self, payload: _Optional[bytes] = ..., from_node_id: _Optional[str] = ..., job_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("payload", "attempt_known", "starved_s", "failed_node_id")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_KNOWN_FIELD_NUMBER: _ClassVar[int]
    STARVED_S_FIELD_NUMBER: _ClassVar[int]
    FAILED_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    attempt_known: bool
    starved_s: float
    failed_node_id: str
    def __init__(self, payload: _Optional[bytes] = ..., attempt_known: _Optional[bool] = ..., starved_s: _Optional[float] = ..., failed_node_id: _Optional[str] = ...) -> None: ...
