"""The served model's tokenizer on the leader, torch-free: `tokenizers` reads the servable's
tokenizer.json and jinja2 renders its chat template the way transformers' apply_chat_template does.

/tokenize, /detokenize and the completions route's prompts use it; a stage still tokenizes chat
messages itself (the leader's copy only counts and echoes them).
"""

from __future__ import annotations

import json
import threading
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from core.servable import TOKENIZER_DIR, load_manifest
from leader.errors import ApiError

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


class ModelTokenizer:
    """One servable's tokenizer and chat template."""

    def __init__(self, model_dir: Path):
        folder = Path(model_dir) / TOKENIZER_DIR
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.specials = {name: _token_text(config.get(name)) for name in _SPECIAL if config.get(name)}
        self.chat_template = load_manifest(model_dir).chat_template or _text(config.get("chat_template"))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_strs(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def check_ids(self, param: str, ids: list[int]) -> None:
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"'{param}' holds token id {bad}, outside this model's vocabulary "
                                f"(0 to {self.vocab_size - 1})", code="invalid_value", param=param)

    def render(self, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
        """The chat template applied to ``messages``, as transformers renders it."""
        if not self.chat_template:
            raise ApiError(400, "This model has no chat template: send a 'prompt' instead of 'messages'",
                           code="invalid_request", param="messages")
        with self._lock:
            if self._template is None:
                self._template = _environment().from_string(self.chat_template)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.specials, **kwargs)
        except jinja2.TemplateError as exc:
            raise ApiError(400, f"The chat template refused these messages: {exc}", code="invalid_messages",
                           param="messages") from None


@lru_cache(maxsize=16)
def tokenizer_for(model_dir: str) -> ModelTokenizer:
    """The tokenizer of a servable folder, read once (a servable's files do not change under a load)."""
    try:
        return ModelTokenizer(Path(model_dir))
    except Exception as exc:  # a missing or unreadable tokenizer.json
        raise ApiError(500, f"The model's tokenizer could not be read: {exc}", code="tokenizer_unavailable") from None


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' template environment: trimmed blocks, loop controls, tojson, raise_exception, strftime_now."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else str(value)


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def check_bias_ids(model_dir: str, bias: dict[str, float] | None) -> None:
    """A 400 naming ``logit_bias`` for a key that is no token id of the model."""
    if bias:
        ids = [int(k) for k in bias]  # validate.logit_bias checked they are integers
        tokenizer_for(model_dir).check_ids("logit_bias", ids)
