"""From a decoded body to the ChatRequest a serving stage runs: roles, content, limits, defaults.

Every value we cannot honour is refused with a 400 that names the parameter; nothing is
silently dropped except fields whose value changes nothing (SDK defaults).
"""

from __future__ import annotations

import time

from events.requests import ChatMessage, ChatRequest, Sampling
from leader.errors import ApiError
from leader.openai.grammar import call_or_answer_grammar, response_format_grammar, response_format_schema
from leader.openai.schema import MAX_LOGPROBS, ChatBody, Message
from leader.openai.tools import call_arguments, check_tools, choice_of, grammar_for

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # OpenAI's seed: a signed 64-bit integer
MAX_N = 128  # choices per request (OpenAI's bound)
MAX_BIAS = 100.0  # |logit_bias| (OpenAI's bound)
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
    if body.functions:
        raise unsupported("functions", "the legacy 'functions' are not served: send them as 'tools'")
    if body.function_call not in (None, "none", "auto"):
        raise unsupported("function_call", "the legacy 'function_call' is not served: use 'tool_choice'")
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
        if msg.role == "tool":
            if not msg.tool_call_id:
                raise bad(f"messages[{i}].tool_call_id", f"messages[{i}] (tool) needs the 'tool_call_id' it answers")
            out.append(ChatMessage(role="tool", content=_content(i, msg), tool_call_id=msg.tool_call_id))
            continue
        role = ROLES.get(msg.role)
        if role is None:
            if msg.role == "function":
                raise unsupported(f"messages[{i}].role", "the legacy 'function' messages are not served: use "
                                                         "'tool' messages")
            raise bad(f"messages[{i}].role", f"messages[{i}].role '{msg.role}' is not one of "
                                             "system, developer, user, assistant, tool")
        calls = []
        if msg.tool_calls:
            if role != "assistant":
                raise bad(f"messages[{i}].tool_calls", f"messages[{i}] ({msg.role}) cannot hold tool calls")
            calls = [call_arguments(i, j, call) for j, call in enumerate(msg.tool_calls)]
        out.append(ChatMessage(role=role, content=_content(i, msg), tool_calls=calls))
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


def min_below_max(body, limit: int) -> int:
    """``limit`` (the reply's max tokens), once ``min_tokens`` is checked against it."""
    if body.min_tokens and body.min_tokens > limit:
        raise bad("min_tokens", f"'min_tokens' ({body.min_tokens}) must not exceed the reply's max tokens ({limit})")
    return limit


def check_sampling(body) -> None:
    """The sampling fields chat and completions share (``body`` is either's)."""
    for param in ("max_tokens", "max_completion_tokens"):
        value = getattr(body, param, None)
        if value is not None and value < 1:
            raise bad(param, f"'{param}' must be at least 1 (got {value})")
    _in_range("temperature", body.temperature, 0.0, 2.0)
    _in_range("top_p", body.top_p, 0.0, 1.0)
    _in_range("min_p", body.min_p, 0.0, 1.0)
    if body.top_p == 0.0:
        raise bad("top_p", "'top_p' must be above 0 (use temperature 0 for greedy decoding)")
    if body.top_k is not None and body.top_k < 0:
        raise bad("top_k", f"'top_k' must be 0 (off) or more (got {body.top_k})")
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise bad("n", f"'n' must be between 1 and {MAX_N} (got {n})")
    if body.seed is not None and not SEED_MIN <= body.seed <= SEED_MAX - (n - 1):
        raise bad("seed", f"'seed' must be a signed 64-bit integer, from {SEED_MIN} to {SEED_MAX} "
                          "(choice i samples with seed + i, which must fit too)")
    _in_range("presence_penalty", body.presence_penalty, -2.0, 2.0)
    _in_range("frequency_penalty", body.frequency_penalty, -2.0, 2.0)
    if body.repetition_penalty is not None and body.repetition_penalty <= 0:
        raise bad("repetition_penalty", f"'repetition_penalty' must be above 0 (got {body.repetition_penalty:g})")
    if body.min_tokens is not None and body.min_tokens < 0:
        raise bad("min_tokens", f"'min_tokens' must be 0 or more (got {body.min_tokens})")
    logit_bias(body.logit_bias)


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` as ids; each bias from -100 to 100."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad("logit_bias", f"'logit_bias' keys are token ids (got '{key}')") from None
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise bad("logit_bias", f"'logit_bias' values must be between -100 and 100 (got {value:g} for {key})")
        out[token] = float(value)
    return out


def check_logprobs(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """Chat's ``logprobs`` / ``top_logprobs`` as the count of candidates a stage returns (None: no logprobs)."""
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise bad("top_logprobs", f"'top_logprobs' must be between 0 and {MAX_LOGPROBS} (got {top_logprobs})")
    if top_logprobs and not logprobs:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
    return (top_logprobs or 0) if logprobs else None


def sampling(body, generation: dict, logprobs: int | None, choice: int = 0, grammar: str = "") -> Sampling:
    """Choice ``choice`` of the request samples with ``seed + choice``: each choice is what its seed gives alone."""
    def pick(name: str, default):
        value = getattr(body, name)
        return value if value is not None else generation.get(name, default)

    return Sampling(temperature=float(pick("temperature", 1.0)), top_p=float(pick("top_p", 1.0)),
                    top_k=int(pick("top_k", 0)), min_p=float(pick("min_p", 0.0)),
                    seed=None if body.seed is None else body.seed + choice,
                    presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                    logit_bias=logit_bias(body.logit_bias), min_tokens=body.min_tokens or 0, logprobs=logprobs,
                    grammar=grammar)


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
    check_logprobs(body.logprobs, body.top_logprobs)
    stop_strings(body.stop)
    enable_thinking(body.chat_template_kwargs)
    request_tools(body)
    request_grammar(body)
    return messages


def request_tools(body: ChatBody) -> tuple[list[dict], str]:
    """(the tools the template renders, the tool choice): no tools with tool_choice "none"."""
    tools = check_tools(body.tools)
    choice = choice_of(body.tool_choice, tools)
    if choice == "none":
        return [], choice
    if body.parallel_tool_calls is False and choice == "auto":
        raise unsupported("parallel_tool_calls", "false is served with tool_choice 'required' or a named function "
                                                 "(one constrained call); with 'auto' the model may write several")
    if body.logprobs:
        raise unsupported("logprobs", "logprobs are not served together with 'tools'")
    return tools, choice


def request_grammar(body: ChatBody, tool_format: str = "hermes") -> str:
    """The grammar the reply must follow: a constrained tool call (in ``tool_format``), or the response
    format's schema."""
    tools, choice = request_tools(body)
    if tools and choice == "auto" and response_format_schema(body.response_format) is not None:
        return call_or_answer_grammar(tools, body.response_format, tool_format)  # a call, or the answer
    if tools:  # a constrained call's grammar; "auto" without a format leaves the reply free
        return grammar_for(choice, tools, tool_format)
    return response_format_grammar(body.response_format)


def chat_request(body: ChatBody, messages: list[ChatMessage], request_id: str, load_id: str,
                 generation: dict, context_tokens: int, choice: int = 0, tool_format: str = "") -> ChatRequest:
    return ChatRequest(
        request_id=request_id, load_id=load_id, model_id=body.model, messages=messages,
        max_tokens=min_below_max(body, max_tokens(body, generation, context_tokens)),
        max_tokens_fit=not max_tokens_given(body),
        sampling=sampling(body, generation, check_logprobs(body.logprobs, body.top_logprobs), choice,
                          grammar=request_grammar(body, tool_format or "hermes")),
        stop=stop_strings(body.stop), enable_thinking=enable_thinking(body.chat_template_kwargs),
        tools=request_tools(body)[0], tool_format=tool_format, created=time.time())
