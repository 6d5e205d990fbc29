from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterRecord(_message.Message):
    __slots__ = ("name", "source", "revision", "digest", "base_model", "rank", "alpha", "target_modules", "use_rslora", "dtype", "size_bytes", "created_at", "last_used_at", "generation", "config_digest", "files_digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FILES_DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    revision: str
    digest: str
    base_model: str
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    use_rslora: bool
    dtype: str
    size_bytes: int
    created_at: float
    last_used_at: float
    generation: int
    config_digest: str
    files_digest: str
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., revision: _Optional[str] = ..., digest: _Optional[str] = ..., base_model: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., use_rslora: _Optional[bool] = ..., dtype: _Optional[str] = ..., size_bytes: _Optional[int] = ..., created_at: _Optional[float] = ..., last_used_at: _Optional[float] = ..., generation: _Optional[int] = ..., config_digest: _Optional[str] = ..., files_digest: _Optional[str] = ...) -> None: ...

class RegisterAdapterRequest(_message.Message):
    __slots__ = ("name", "source", "revision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    revision: str
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListStoreAdaptersRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListStoreAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterRecord]
    next_page_token: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterRecord, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("name", "deleted")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    name: str
    deleted: bool
    def __init__(self, name: _Optional[str] = ..., deleted: _Optional[bool] = ...) -> None: ...

class PullAdapterRequest(_message.Message):
    __slots__ = ("name", "shared_cache")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHARED_CACHE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shared_cache: bool
    def __init__(self, name: _Optional[str] = ..., shared_cache: _Optional[bool] = ...) -> None: ...

class AdapterHeader(_message.Message):
    __slots__ = ("record", "adapter_config_json", "local_safetensors_path", "files")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SAFETENSORS_PATH_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    record: AdapterRecord
    adapter_config_json: str
    local_safetensors_path: str
    files: _containers.RepeatedCompositeFieldContainer[AdapterFile]
    def __init__(self, record: _Optional[_Union[AdapterRecord, _Mapping]] = ..., adapter_config_json: _Optional[str] = ..., local_safetensors_path: _Optional[str] = ..., files: _Optional[_Iterable[_Union[AdapterFile, _Mapping]]] = ...) -> None: ...

class AdapterFile(_message.Message):
    __slots__ = ("name", "content")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    content: bytes
    def __init__(self, name: _Optional[str] = ..., content: _Optional[bytes] = ...) -> None: ...

class AdapterChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: AdapterHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[AdapterHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WatchAdaptersRequest(_message.Message):
    __slots__ = ("last_event_id",)
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    last_event_id: str
    def __init__(self, last_event_id: _Optional[str] = ...) -> None: ...

class AdapterEvent(_message.Message):
    __slots__ = ("id", "type", "name", "digest", "generation", "time", "config_digest", "files_digest")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FILES_DIGEST_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    name: str
    digest: str
    generation: int
    time: float
    config_digest: str
    files_digest: str
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., name: _Optional[str] = ..., digest: _Optional[str] = ..., generation: _Optional[int] = ..., time: _Optional[float] = ..., config_digest: _Optional[str] = ..., files_digest: _Optional[str] = ...) -> None: ...
