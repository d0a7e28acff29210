from epochmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LedgerEntry(_message.Message):
    __slots__ = ("id", "time_ms", "from_account", "to_account", "amount_micro", "reason", "job_id", "round", "node_id", "samples")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIME_MS_FIELD_NUMBER: _ClassVar[int]
    FROM_ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    TO_ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_MICRO_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    id: int
    time_ms: int
    from_account: str
    to_account: str
    amount_micro: int
    reason: str
    job_id: str
    round: int
    node_id: str
    samples: int
    def __init__(self, id: _Optional[int] = ..., time_ms: _Optional[int] = ..., from_account: _Optional[str] = ..., to_account: _Optional[str] = ..., amount_micro: _Optional[int] = ..., reason: _Optional[str] = ..., job_id: _Optional[str] = ..., round: _Optional[int] = ..., node_id: _Optional[str] = ..., samples: _Optional[int] = ...) -> None: ...

class GrantCreditsRequest(_message.Message):
    __slots__ = ("account", "amount_micro", "create")
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_MICRO_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    account: str
    amount_micro: int
    create: bool
    def __init__(self, account: _Optional[str] = ..., amount_micro: _Optional[int] = ..., create: _Optional[bool] = ...) -> None: ...

class GrantCreditsResponse(_message.Message):
    __slots__ = ("entry", "balance_micro")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    BALANCE_MICRO_FIELD_NUMBER: _ClassVar[int]
    entry: LedgerEntry
    balance_micro: int
    def __init__(self, entry: _Optional[_Union[LedgerEntry, _Mapping]] = ..., balance_micro: _Optional[int] = ...) -> None: ...

class GetBalanceRequest(_message.Message):
    __slots__ = ("account", "all", "known")
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    account: str
    all: bool
    known: bool
    def __init__(self, account: _Optional[str] = ..., all: _Optional[bool] = ..., known: _Optional[bool] = ...) -> None: ...

class AccountBalance(_message.Message):
    __slots__ = ("account", "balance_micro")
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    BALANCE_MICRO_FIELD_NUMBER: _ClassVar[int]
    account: str
    balance_micro: int
    def __init__(self, account: _Optional[str] = ..., balance_micro: _Optional[int] = ...) -> None: ...

class GetBalanceResponse(_message.Message):
    __slots__ = ("balances",)
    BALANCES_FIELD_NUMBER: _ClassVar[int]
    balances: _containers.RepeatedCompositeFieldContainer[AccountBalance]
    def __init__(self, balances: _Optional[_Iterable[_Union[AccountBalance, _Mapping]]] = ...) -> None: ...

class GetStatementRequest(_message.Message):
    __slots__ = ("account", "job_id", "after_id", "limit")
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    account: str
    job_id: str
    after_id: int
    limit: int
    def __init__(self, account: _Optional[str] = ..., job_id: _Optional[str] = ..., after_id: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class GetStatementResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ...) -> None: ...

class AddBudgetRequest(_message.Message):
    __slots__ = ("job_id", "amount_micro")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_MICRO_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    amount_micro: int
    def __init__(self, job_id: _Optional[str] = ..., amount_micro: _Optional[int] = ...) -> None: ...
