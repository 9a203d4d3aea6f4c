"""POST /v1/completions (and /api/v1/…): a prompt (text or token ids) continued, whole or streamed.

The gateway tokenizes the prompt with the model's tokenizer (leader/openai/tokenizer.py) and sends
its ids; auth, admission, timing and cancels are chat's, one request per choice (leader/api/choices.py).
"""

from __future__ import annotations

from litestar import Request, Response, post
from litestar.params import JSONBody

from events.base import new_id
from leader.api.body import StructBody
from leader.api.choices import Choices, text_of
from leader.api.deps import Caller, ChatTimeout, LeaderDep, ServingDep, StreamsDep
from leader.openai import prompt_logprobs as scores
from leader.openai.completions import (
    CompletionBody,
    CompletionChunks,
    TextCompletion,
    check_body,
    completion_requests,
    decode_body,
    prompts,
    whole,
)
from leader.openai.schema import empty_body
from leader.openai.tokenizer import check_bias_ids, tokenizer_for


class CompletionBodyDTO(StructBody[CompletionBody]):
    decode = staticmethod(decode_body)


@post(["/v1/completions", "/api/v1/completions"], opt={"scope": "operate"}, status_code=200,
      dto=CompletionBodyDTO, return_dto=None,
      tags=["chat"], summary="OpenAI (legacy) completions, streamed as SSE chunks or in one reply")
async def completions(request: Request, leader: LeaderDep, serving: ServingDep, streams: StreamsDep,
                      caller: Caller, chat_timeout_s: ChatTimeout,
                      data: JSONBody[CompletionBody | None] = None) -> Response[TextCompletion]:
    """The reply is a text_completion, or with ``stream`` its chunks as server-sent events."""
    if data is None:
        raise empty_body()
    body = data
    check_body(body)
    ready = await serving.ready_load(body.model, leader.settings.leader.autoload)
    tok = tokenizer_for(ready.model_dir)
    check_bias_ids(ready.model_dir, body.logit_bias)
    given = prompts(body, tok)
    n = body.n or 1
    chats = completion_requests(body, [ids for ids, _ in given], [new_id() for _ in range(len(given) * n)],
                                ready.load_id, ready.generation, ready.context_tokens)
    echoes = [text if body.echo else "" for _, text in given for _ in range(n)]
    scoring = scores.scoring(body, [ids for ids, _ in given], [tok.decode(ids[:1]) for ids, _ in given], echoes)
    choices = await Choices.open(leader, streams, chats, bool(body.stream), caller.token_id if caller else "",
                                 chat_timeout_s, echoes)
    cid, created = "cmpl-" + chats[0].request_id, int(chats[0].created)
    if not body.stream:
        return await choices.whole(request, lambda answers: whole(cid, created, body.model, answers, len(given),
                                                                  scoring))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    enc = CompletionChunks(cid, created, body.model, include_usage)
    return choices.stream(
        enc.echo,
        lambda a, f: enc.text(a.index, text_of(f), f.logprobs if a.logprobs is not None else None)
        if text_of(f) or f.logprobs else None,
        lambda a, last: enc.finish(a, last and not include_usage),
        lambda: enc.end(choices.answers, len(given)))
