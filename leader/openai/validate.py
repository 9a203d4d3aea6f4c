"""From a decoded body to the ChatRequest a serving stage runs: roles, content, limits, defaults.

Every value we cannot honour is refused with a 400 that names the parameter; nothing is
silently dropped except fields whose value changes nothing (SDK defaults).
"""

from __future__ import annotations

import time

from events.requests import ChatMessage, ChatRequest, Sampling
from leader.errors import ApiError
from leader.openai.schema import ChatBody, Message

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # OpenAI's seed: a signed 64-bit integer
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 4


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"'{param}' is not supported: {why}", code="unsupported_parameter", param=param)


def _in_range(param: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        raise bad(param, f"'{param}' must be between {low:g} and {high:g} (got {value:g})")


def check_unsupported(body: ChatBody) -> None:
    """Refuse what this server cannot do with the value given; defaults pass."""
    if body.n not in (None, 1):
        raise unsupported("n", f"this server returns one choice per request (got n={body.n})")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        _in_range(name, value, -2.0, 2.0)
        if value:
            raise unsupported(name, "penalties are not applied by this server; leave it at 0")
    if body.repetition_penalty not in (None, 1.0):
        raise unsupported("repetition_penalty", "penalties are not applied by this server; leave it at 1")
    if body.logit_bias:
        raise unsupported("logit_bias", "token biases are not applied by this server")
    if body.logprobs:
        raise unsupported("logprobs", "this server does not return log probabilities")
    if body.top_logprobs:
        raise unsupported("top_logprobs", "this server does not return log probabilities")
    for name in ("tools", "functions"):
        if getattr(body, name):
            raise unsupported(name, "this server does not call tools")
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none", "auto"):
            raise unsupported(name, "this server does not call tools")
    if body.response_format is not None and body.response_format.type != "text":
        raise unsupported("response_format", f"only type 'text' is served (got '{body.response_format.type}')")
    if body.modalities and set(body.modalities) != {"text"}:
        raise unsupported("modalities", "this server answers with text only")
    if body.audio:
        raise unsupported("audio", "this server answers with text only")


def _content(i: int, msg: Message) -> str:
    content = msg.content
    if content is None:
        if msg.role == "assistant":
            return ""
        raise bad(f"messages[{i}].content", f"messages[{i}] ({msg.role}) has no content")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise unsupported(f"messages[{i}].content[{j}].type",
                              f"only text parts are served (got '{part.type}')")
        if part.text is None:
            raise bad(f"messages[{i}].content[{j}].text", f"messages[{i}].content[{j}] has no text")
        texts.append(part.text)
    return "".join(texts)


def chat_messages(messages: list[Message]) -> list[ChatMessage]:
    if not messages:
        raise bad("messages", "'messages' must hold at least one message", code="invalid_messages")
    out = []
    for i, msg in enumerate(messages):
        role = ROLES.get(msg.role)
        if role is None:
            if msg.role in ("tool", "function"):
                raise unsupported(f"messages[{i}].role", f"'{msg.role}' messages need tools, which this server does not call")
            raise bad(f"messages[{i}].role", f"messages[{i}].role '{msg.role}' is not one of "
                                             "system, developer, user, assistant")
        if msg.tool_calls:
            raise unsupported(f"messages[{i}].tool_calls", "this server does not call tools")
        out.append(ChatMessage(role=role, content=_content(i, msg)))
    return out


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP:
        raise bad("stop", f"'stop' holds at most {MAX_STOP} sequences (got {len(stops)})")
    if any(s == "" for s in stops):
        raise bad("stop", "'stop' sequences must not be empty")
    return stops


def max_tokens_given(body: ChatBody) -> bool:
    return body.max_completion_tokens is not None or body.max_tokens is not None


def max_tokens(body: ChatBody, generation: dict, context_tokens: int) -> int:
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    value = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if value is None:
        value = int(generation.get("max_new_tokens") or 512)
        return min(value, context_tokens) if context_tokens > 0 else value
    if context_tokens > 0 and value > context_tokens:
        raise bad(param, f"'{param}' is {value}, but this model serves at most {context_tokens} tokens "
                         "per conversation", code="context_length_exceeded")
    return value


def check_sampling(body: ChatBody) -> None:
    for param in ("max_tokens", "max_completion_tokens"):
        value = getattr(body, param)
        if value is not None and value < 1:
            raise bad(param, f"'{param}' must be at least 1 (got {value})")
    _in_range("temperature", body.temperature, 0.0, 2.0)
    _in_range("top_p", body.top_p, 0.0, 1.0)
    _in_range("min_p", body.min_p, 0.0, 1.0)
    if body.top_p == 0.0:
        raise bad("top_p", "'top_p' must be above 0 (use temperature 0 for greedy decoding)")
    if body.top_k is not None and body.top_k < 0:
        raise bad("top_k", f"'top_k' must be 0 (off) or more (got {body.top_k})")
    if body.seed is not None and not SEED_MIN <= body.seed <= SEED_MAX:
        raise bad("seed", f"'seed' must be a signed 64-bit integer, from {SEED_MIN} to {SEED_MAX}")


def sampling(body: ChatBody, generation: dict) -> Sampling:
    def pick(name: str, default):
        value = getattr(body, name)
        return value if value is not None else generation.get(name, default)

    return Sampling(temperature=float(pick("temperature", 1.0)), top_p=float(pick("top_p", 1.0)),
                    top_k=int(pick("top_k", 0)), min_p=float(pick("min_p", 0.0)), seed=body.seed)


def enable_thinking(kwargs: dict | None) -> bool | None:
    """Only ``enable_thinking`` of chat_template_kwargs reaches the chat template."""
    value = (kwargs or {}).get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise bad("chat_template_kwargs.enable_thinking", "'chat_template_kwargs.enable_thinking' must be "
                                                          "true or false")
    return value


def check_body(body: ChatBody) -> list[ChatMessage]:
    """What needs no model: run before the model is resolved, so a bad request costs nothing."""
    if not body.model:
        raise bad("model", "'model' must name a model (see GET /v1/models)")
    messages = chat_messages(body.messages)
    check_unsupported(body)
    check_sampling(body)
    stop_strings(body.stop)
    enable_thinking(body.chat_template_kwargs)
    return messages


def chat_request(body: ChatBody, messages: list[ChatMessage], request_id: str, load_id: str,
                 generation: dict, context_tokens: int) -> ChatRequest:
    return ChatRequest(
        request_id=request_id, load_id=load_id, model_id=body.model, messages=messages,
        max_tokens=max_tokens(body, generation, context_tokens), max_tokens_fit=not max_tokens_given(body),
        sampling=sampling(body, generation),
        stop=stop_strings(body.stop), enable_thinking=enable_thinking(body.chat_template_kwargs),
        created=time.time())
