"""Request bodies: read with a bound on each wait, and decoded into msgspec Structs by the route's own decoder.

Litestar's own decoding would answer a bad body with its generic validation error; ours names
the offending param in OpenAI's error object. `StructBody[T]` keeps that decoder and still lets
Litestar describe the body in the OpenAPI schema as the Struct ``T`` itself::

    class ChatBodyDTO(StructBody[ChatBody]):
        decode = staticmethod(decode_body)

    @post(..., dto=ChatBodyDTO, return_dto=None)
    async def handler(data: ChatBody | None = None): ...  # None: the request had no body at all
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any, Callable, ClassVar, TypeVar

from litestar.dto import AbstractDTO
from litestar.dto.data_structures import DTOFieldDefinition
from litestar.openapi.spec import Reference, Schema
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from litestar.typing import FieldDefinition

from leader.errors import ApiError

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


def body_read_timeout(timeout_s: float) -> Callable[[ASGIApp], ASGIApp]:
    """Middleware: a request whose body stops arriving for `timeout_s` (shorter than its Content-Length,
    say) is answered 408 instead of holding the connection; once the body is in, reads are not bounded
    (the chat route waits on them for a client's hang-up)."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def bounded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            body_in = False

            async def receive_body() -> Message:
                nonlocal body_in
                if body_in:
                    return await receive()
                try:  # a timeout scope, not wait_for's task a call (on the way to a first token)
                    async with asyncio.timeout(timeout_s):
                        message = await receive()
                except TimeoutError:
                    raise ApiError(408, f"The request body did not arrive within {timeout_s:g}s",
                                   code="request_timeout") from None
                body_in = message["type"] != "http.request" or not message.get("more_body", False)
                return message

            await app(scope, receive_body, send)

        return bounded

    return middleware


JSON_TYPES = ("application/json", "")  # no Content-Type: taken as JSON, as before (curl --data-binary)


def json_bodies_only(app: ASGIApp) -> ASGIApp:
    """Middleware: a body sent as another media type (text/plain, a form) is answered 415 rather than
    read as JSON; every body this API takes is JSON."""

    async def checked(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH", "DELETE"):
            raw = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
            media = raw.split(";", 1)[0].strip().lower()
            if media not in JSON_TYPES and not media.endswith("+json"):
                raise ApiError(415, f"The request body must be JSON (Content-Type: application/json), not {media!r}",
                               code="unsupported_media_type")
        await app(scope, receive, send)

    return checked
