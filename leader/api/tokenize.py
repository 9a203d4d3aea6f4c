"""POST /tokenize and /detokenize, as vLLM serves them, with the served model's own tokenizer on the leader."""

from __future__ import annotations

import msgspec
from litestar import post
from litestar.params import JSONBody

from leader.api.body import StructBody
from leader.api.deps import LeaderDep, ServingDep
from leader.openai.schema import Message, decode_struct, empty_body
from leader.openai.tokenizer import ModelTokenizer, tokenizer_for
from leader.openai.validate import bad, chat_messages, enable_thinking, unsupported
from leader.serving import Serving


class TokenizeBody(msgspec.Struct, kw_only=True):
    """vLLM's two forms: a ``prompt``, or chat ``messages`` rendered with the model's template."""

    model: str
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None  # vLLM: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict | None = None
    tools: list | None = None


class TokenizeReply(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeBody(msgspec.Struct, kw_only=True):
    model: str
    tokens: list[int]


class DetokenizeReply(msgspec.Struct, kw_only=True):
    prompt: str


def _decoder(struct):
    decoder = msgspec.json.Decoder(struct)

    def decode(body: bytes):
        if not body.strip():
            raise empty_body()
        return decode_struct(body, decoder)

    return staticmethod(decode)


class TokenizeDTO(StructBody[TokenizeBody]):
    decode = _decoder(TokenizeBody)


class DetokenizeDTO(StructBody[DetokenizeBody]):
    decode = _decoder(DetokenizeBody)


async def model_tokenizer(serving: Serving, model_id: str, autoload: bool) -> tuple[ModelTokenizer, int]:
    """The tokenizer of a served model, and its context length; the same 404/409s as chat."""
    if not model_id:
        raise bad("model", "'model' must name a model (see GET /v1/models)")
    ready = await serving.ready_load(model_id, autoload)
    return tokenizer_for(ready.model_dir), ready.context_tokens


def tokenize_ids(tok: ModelTokenizer, body: TokenizeBody) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise bad("prompt", "send exactly one of 'prompt' and 'messages'")
    if body.prompt is not None:
        return tok.encode(body.prompt, body.add_special_tokens is not False)
    if body.tools:
        raise unsupported("tools", "this server does not call tools")
    if body.continue_final_message:
        raise unsupported("continue_final_message", "the last message is always closed by the template")
    messages = [{"role": m.role, "content": m.content} for m in chat_messages(body.messages)]
    thinking = enable_thinking(body.chat_template_kwargs)
    text = tok.render(messages, body.add_generation_prompt,
                      **({} if thinking is None else {"enable_thinking": thinking}))
    return tok.encode(text, bool(body.add_special_tokens))


@post(["/tokenize", "/v1/tokenize"], opt={"scope": "operate"}, status_code=200, dto=TokenizeDTO, return_dto=None,
      tags=["tokenize"], summary="A prompt or chat messages as the model's token ids (vLLM's /tokenize)")
async def tokenize(leader: LeaderDep, serving: ServingDep,
                   data: JSONBody[TokenizeBody | None] = None) -> TokenizeReply:
    if data is None:
        raise empty_body()
    tok, context = await model_tokenizer(serving, data.model, leader.settings.leader.autoload)
    ids = tokenize_ids(tok, data)
    return TokenizeReply(count=len(ids), max_model_len=context, tokens=ids,
                         token_strs=tok.token_strs(ids) if data.return_token_strs else None)


@post(["/detokenize", "/v1/detokenize"], opt={"scope": "operate"}, status_code=200, dto=DetokenizeDTO,
      return_dto=None, tags=["tokenize"], summary="Token ids back to text (vLLM's /detokenize)")
async def detokenize(leader: LeaderDep, serving: ServingDep,
                     data: JSONBody[DetokenizeBody | None] = None) -> DetokenizeReply:
    if data is None:
        raise empty_body()
    tok, _ = await model_tokenizer(serving, data.model, leader.settings.leader.autoload)
    tok.check_ids("tokens", data.tokens)
    return DetokenizeReply(prompt=tok.decode(data.tokens))
