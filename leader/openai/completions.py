"""OpenAI's legacy completions: the request body, its ChatRequests (a prompt of token ids each), the replies."""

from __future__ import annotations

import time

import msgspec
from msgspec import UNSET, UnsetType

from events.frames import TokenLogprob
from events.requests import ChatRequest
from leader.openai import prompt_logprobs as scores
from leader.openai.replies import Answer, Reply, timing_of, total_usage
from leader.openai.schema import MAX_LOGPROBS, StreamOptions, decode_struct, empty_body
from leader.openai.tokenizer import ModelTokenizer
from leader.openai.validate import bad, check_sampling, min_below_max, sampling, stop_strings, unsupported

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions
_enc = msgspec.json.Encoder()


class CompletionBody(msgspec.Struct, kw_only=True):
    """Every field a client may send; unknown ones are ignored, as for chat."""

    model: str
    prompt: str | list
    suffix: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs with this many candidates


_decoder = msgspec.json.Decoder(CompletionBody)


def decode_body(body: bytes) -> CompletionBody:
    if not body.strip():
        raise empty_body()
    return decode_struct(body, _decoder)


def check_body(body: CompletionBody) -> None:
    """What needs no model."""
    if not body.model:
        raise bad("model", "'model' must name a model (see GET /v1/models)")
    if body.suffix:
        raise unsupported("suffix", "this server does not fill in the middle")
    if body.best_of not in (None, 1) and body.best_of != body.n:
        raise unsupported("best_of", "this server returns every choice it samples; use 'n'")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise bad("logprobs", f"'logprobs' must be between 0 and {MAX_LOGPROBS} (got {body.logprobs})")
    scores.check(body)
    check_sampling(msgspec.structs.replace(body, max_tokens=None) if body.max_tokens == 0 else body)
    stop_strings(body.stop)


def prompts(body: CompletionBody, tok: ModelTokenizer) -> list[tuple[list[int], str]]:
    """Each prompt as (token ids, its text for echo): a string, token ids, or a list of either."""
    raw = body.prompt
    if isinstance(raw, str) or (raw and all(isinstance(i, int) for i in raw)):
        raw = [raw]
    if not raw:
        raise bad("prompt", "'prompt' must not be empty")
    out = []
    for i, prompt in enumerate(raw):
        param = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            tok.check_ids(param, prompt)
            ids, text = list(prompt), tok.decode(prompt) if body.echo else ""
        else:
            raise bad(param, f"'{param}' must be a string or a list of token ids")
        if not ids:
            raise bad(param, f"'{param}' holds no tokens")
        out.append((ids, text))
    return out


def completion_requests(body: CompletionBody, ids: list[list[int]], request_ids: list[str], load_id: str,
                        generation: dict, context_tokens: int) -> list[ChatRequest]:
    """``n`` requests per prompt, prompt after prompt; choice j of a prompt samples with seed + j."""
    n = body.n or 1
    # scoring only (max_tokens 0 with echo): one token is drawn and dropped (leader.openai.prompt_logprobs)
    limit = 1 if body.max_tokens == 0 else body.max_tokens or DEFAULT_MAX_TOKENS
    if context_tokens > 0 and limit > context_tokens:
        raise bad("max_tokens", f"'max_tokens' is {limit}, but this model serves at most {context_tokens} tokens "
                                "per request", code="context_length_exceeded")
    min_below_max(body, limit)
    stops = stop_strings(body.stop)
    created = time.time()
    top = scores.asked(body)
    return [ChatRequest(request_id=request_ids[p * n + j], load_id=load_id, model_id=body.model, messages=[],
                        prompt_ids=prompt, max_tokens=limit, stop=stops, created=created,
                        sampling=msgspec.structs.replace(sampling(body, generation, body.logprobs, j),
                                                         prompt_logprobs=top))
            for p, prompt in enumerate(ids) for j in range(n)]


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict:
    """The completions shape: parallel lists, ``top_logprobs`` as {token: logprob}, offsets into the text."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {"text_offset": offsets, "token_logprobs": [e.logprob for e in entries],
            "tokens": [e.token for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries]}


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: dict | None = None
    finish_reason: str
    prompt_logprobs: list | UnsetType = UNSET  # vLLM's, where asked


def scored_choice(a: Answer, s: scores.Scoring) -> CompletionChoice:
    """A choice whose prompt was scored (or only echoed, max_tokens 0): the prompt's logprobs ahead of the
    reply's; scoring only, the prompt alone, its drawn token dropped (and out of the usage)."""
    prompt = s.prompt_of(a.index)
    reply = [] if s.only else (a.logprobs or [])
    if s.only:
        a.done = msgspec.structs.replace(a.done, completion_tokens=0, finish_reason="length")
    logprobs = (scores.echo_logprobs(s.first_texts[prompt], a.prompt_logprobs, reply, s.echo_top)
                if s.echo_top is not None else
                None if a.logprobs is None else completion_logprobs(reply, len(s.echoes[a.index])))
    return CompletionChoice(index=a.index, text=s.echoes[a.index] if s.only else a.text, logprobs=logprobs,
                            finish_reason=a.done.finish_reason,
                            prompt_logprobs=UNSET if s.vllm_top is None else
                            scores.vllm_prompt_logprobs(s.prompt_ids[prompt], a.prompt_logprobs, s.vllm_top))


class TextCompletion(Reply, kw_only=True):
    object: str = "text_completion"
    choices: list[CompletionChoice]


def whole(completion_id: str, created: int, model: str, answers: list[Answer], prompts: int,
          scoring: scores.Scoring | None = None) -> bytes:
    choices = [scored_choice(a, scoring) if scoring is not None else
               CompletionChoice(index=a.index, text=a.text, finish_reason=a.done.finish_reason,
                                logprobs=None if a.logprobs is None else completion_logprobs(a.logprobs, 0))
               for a in answers]
    return _enc.encode(TextCompletion(id=completion_id, created=created, model=model,
                                      usage=total_usage(answers, prompts), choices=choices,
                                      swarm=timing_of(answers[0].done)))


class CompletionChunks:
    """SSE events of a streamed completion."""

    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool):
        self._head = (b'data: {"id":' + _enc.encode(completion_id) + b',"object":"text_completion","created":'
                      + _enc.encode(created) + b',"model":' + _enc.encode(model)
                      + b',"system_fingerprint":null,"choices":')
        self._no_usage = b',"usage":null' if include_usage else b""
        self.include_usage = include_usage
        self._offsets: dict[int, int] = {}  # per choice: the text sent so far, for text_offset

    def _chunk(self, index: int, text: str, logprobs: bytes = b"null", reason: bytes = b"null",
               swarm: bytes = b"") -> bytes:
        return (self._head + b'[{"index":' + str(index).encode() + b',"text":' + _enc.encode(text)
                + b',"logprobs":' + logprobs + b',"finish_reason":' + reason + b"}]" + self._no_usage + swarm
                + b"}\n\n")

    def echo(self, answer: Answer) -> bytes:
        """The echoed prompt, first (nothing without echo)."""
        text = answer.text
        self._offsets[answer.index] = len(text)
        return self._chunk(answer.index, text) if text else b""

    def text(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> bytes:
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(text)
        lp = _enc.encode(completion_logprobs(logprobs, offset)) if logprobs is not None else b"null"
        return self._chunk(index, text, lp)

    def finish(self, answer: Answer, last: bool) -> bytes:
        done = answer.done
        swarm = b',"swarm":' + _enc.encode({"timing": done.timing}) if last and done.timing else b""
        return self._chunk(answer.index, "", reason=_enc.encode(done.finish_reason), swarm=swarm)

    def end(self, answers: list[Answer], prompts: int) -> bytes:
        if not self.include_usage:
            return b""
        done = answers[0].done
        swarm = b',"swarm":' + _enc.encode({"timing": done.timing}) if done.timing else b""
        return self._head + b'[],"usage":' + _enc.encode(total_usage(answers, prompts)) + swarm + b"}\n\n"
