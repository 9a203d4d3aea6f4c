"""Chat requests (SWARM_REQUESTS) and their audit events (accepted / finished / failed)."""

from __future__ import annotations

import msgspec

from events.base import Event
from events.moves import Resume


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str
    content: str = ""
    tool_calls: list[dict] = []  # an assistant's calls: {id, type, function: {name, arguments (an object)}}
    tool_call_id: str = ""  # a tool message's: the call it answers


MAX_LOGPROBS = 20  # top candidates a request may ask for (OpenAI's top_logprobs bound)


class Sampling(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request's sampling, the one declaration the gateway, the ring's first frame and the engine share.

    Filled in by the leader from the model's generation config; temperature 0 is greedy, and 0 / 1.0
    switch the other filters off. ``check()`` says what is out of range (the stage refuses such a request).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's: divides positive logits of prompt and output tokens
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0  # vLLM's: end-of-turn ids are barred until this many tokens came
    logprobs: int | None = None  # the sampled token's logprob plus this many top candidates
    grammar: str = ""  # an llguidance grammar the reply must follow (structured outputs, tool calls)
    prompt_logprobs: int | None = None  # each prompt token's logprob (the first has none) plus this many top
    # a moved request: the reply tokens an earlier stage sampled; its generator first draws and drops theirs
    # (fellow.runtime.server.moved), so a seeded reply goes on as it would have
    drawn: int = 0

    def check(self) -> "Sampling":
        """Itself, or ValueError naming the first field out of range."""
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_LOGPROBS:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, {MAX_LOGPROBS}]")
        return self

    @property
    def adjusts(self) -> bool:
        """Whether a logits processor changes this request's logits before it samples."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.grammar)

    @property
    def greedy(self) -> bool:
        # top_k 1 keeps only the argmax, so it needs no random draw either
        return self.temperature == 0.0 or self.top_k == 1


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway publishes on ``swarm.req.<load>``; stage 0 pulls it when it has room."""

    request_id: str
    load_id: str
    model_id: str
    messages: list[ChatMessage]
    max_tokens: int
    prompt_ids: list[int] = []  # a completion's prompt, tokenized by the gateway; then messages is empty
    max_tokens_fit: bool = False  # a default, not the client's: shorten it to what fits beside the prompt
    sampling: Sampling = Sampling()
    stop: list[str] = []
    enable_thinking: bool | None = None
    tools: list[dict] = []  # OpenAI function tools the chat template renders; their calls are parsed from the reply
    tool_format: str = ""  # how the template writes calls (leader.openai.tool_formats); "": hermes
    created: float = 0.0
    frame_key: str = ""  # the stage signs its frames with it (events.frames.frame_tag); "": a leader without NATS auth
    resume: Resume | None = None  # a request moved mid-reply off a stage that died (leader.moves)
    # a reply's check (leader.verify): these fellows may not take it, and the stage scores its prompt followed by
    # these ids (the reply being checked) teacher-forced
    not_by: list[str] = []
    scored_ids: list[int] = []


class RequestAccepted(Event, frozen=True, tag="request.accepted"):
    request_id: str
    model_id: str
    load_id: str
    stream: bool = False
    max_tokens: int = 0
    token_id: str = ""  # the API token's id (never its secret)
    api: str = "openai"  # the HTTP API it came through: openai, anthropic or ollama


class RequestFinished(Event, frozen=True, tag="request.finished"):
    request_id: str
    model_id: str
    load_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"
    ttft_s: float | None = None
    duration_s: float = 0.0
    tokens_per_s: float = 0.0
    timing: dict = {}
    fellow_id: str = ""  # the fellow whose stage 0 served it


class RequestFailed(Event, frozen=True, tag="request.failed"):
    request_id: str
    model_id: str
    load_id: str = ""
    code: str = "internal_error"
    message: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    fellow_id: str = ""


def request_failed_id(request_id: str) -> str:
    """One RequestFailed per request, whoever reports it (stage or gateway): JetStream keeps the first."""
    return f"fail-{request_id}"


def request_finished_id(request_id: str) -> str:
    return f"fin-{request_id}"
