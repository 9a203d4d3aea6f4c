"""A servable whose greedy reply to any chat is one Hermes tool call: a tiny random Qwen3 with the call's
whole text (``<tool_call>...</tool_call>``) added to its tokenizer as one token, and a bigram table
(tests/copying.py) planted so that the generation prompt's last token (``\\n``, or ``\\n\\n`` after a
closed think block) is followed by that token, and it by ``<|im_end|>``. A random model never calls a
tool and Ollama's API has no ``tool_choice`` to force one; this one calls deterministically."""

from __future__ import annotations

import json
from pathlib import Path


def tool_call_text(name: str, arguments: dict) -> str:
    """The call as Qwen3's (Hermes) template writes it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def make_tool_caller(root: Path, model_id: str, name: str, arguments: dict) -> Path:
    """Write ``root/servables/model_id``, a one-stage servable that calls ``name`` with ``arguments``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fellow.runtime.tools.export import export
    from tests.copying import plant_bigrams
    from tests.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(root / f"hf-{model_id}", family="qwen3", layers=2, seed=4, tie_embeddings=False)
    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    call = tool_call_text(name, arguments)
    assert tokenizer.add_tokens([call]) == 1
    tokenizer.save_pretrained(str(hf))
    model = AutoModelForCausalLM.from_pretrained(str(hf))
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    [call_id], [end] = tokenizer.convert_tokens_to_ids([call]), tokenizer.encode("<|im_end|>", add_special_tokens=False)
    newline, blank = (tokenizer.encode(s, add_special_tokens=False) for s in ("\n", "\n\n"))
    assert len(newline) == len(blank) == 1, (newline, blank)
    plant_bigrams(model, [newline[0], call_id, end, blank[0], call_id, end])
    model.save_pretrained(str(hf))
    out = root / "servables" / model_id
    export(hf, out, stages=1, model_id=model_id)
    return out
