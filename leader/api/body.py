"""Request bodies as msgspec Structs, decoded by the route's own decoder.

Litestar's own decoding would answer a bad body with its generic validation error; ours names
the offending param in OpenAI's error object. `StructBody[T]` keeps that decoder and still lets
Litestar describe the body in the OpenAPI schema as the Struct ``T`` itself::

    class ChatBodyDTO(StructBody[ChatBody]):
        decode = staticmethod(decode_body)

    @post(..., dto=ChatBodyDTO, return_dto=None)
    async def handler(data: ChatBody | None = None): ...  # None: the request had no body at all
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Callable, ClassVar, TypeVar

from litestar.dto import AbstractDTO
from litestar.dto.data_structures import DTOFieldDefinition
from litestar.openapi.spec import Reference, Schema
from litestar.typing import FieldDefinition

T = TypeVar("T")


class StructBody(AbstractDTO[T]):
    decode: ClassVar[Callable[[bytes], Any]]  # raw bytes to T, or an ApiError naming the param

    def decode_bytes(self, value: bytes) -> Any:
        return type(self).decode(value)

    @classmethod
    def generate_field_definitions(cls, model_type: type[Any]) -> Generator[DTOFieldDefinition, None, None]:
        yield from ()  # no transfer model: `decode` builds T itself

    @classmethod
    def detect_nested_field(cls, field_definition: FieldDefinition) -> bool:
        return False

    @classmethod
    def create_for_field_definition(cls, field_definition: FieldDefinition, handler_id: str,
                                    backend_cls: Any = None) -> None:
        """Nothing to build: decoding is `decode`, the schema is T's own."""

    @classmethod
    def create_openapi_schema(cls, field_definition: FieldDefinition, handler_id: str,
                              schema_creator: Any) -> Reference | Schema:
        return schema_creator.for_field_definition(
            FieldDefinition.from_annotation(cls.model_type, kwarg_definition=field_definition.kwarg_definition))
