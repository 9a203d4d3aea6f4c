"""The draft model of a drafting load (SWARM_SERVE_DRAFT_MODEL on the leader, the spec's TS9).

A load that drafts (speculative k > 0) has its last stage guess with a small model of the same
vocabulary (fellow.runtime.ring.drafts). The leader chooses it from its catalog when it places the
load: ``auto`` takes the smallest servable of the served model's architecture with fewer parameters
and the same vocabulary (Qwen3-0.6B for a Qwen3 model, where the catalog has it); a model id takes
that servable where it shares the vocabulary. Where none fits, or a fellow of the load does not
declare serve-draft-model (placement.for_old_fellows), the load drafts by prompt lookup alone and its
status says why. The chosen id travels in the transport (``draft_model``), and the last stage's fellow
finds or fetches its folder like a served model's (LoadStage.draft_path, draft_sha256).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from core.servable import TOKENIZER_DIR
from leader.db.tables import Model

AUTO = "auto"


@lru_cache(maxsize=32)
def _vocabulary(path: str, manifest_sha256: str) -> tuple[tuple[str, int], ...] | None:
    """A servable's token strings and ids (its tokenizer.json), or None where it has none readable."""
    try:
        tokenizer = Tokenizer.from_file(str(Path(path) / TOKENIZER_DIR / "tokenizer.json"))
    except Exception:  # noqa: BLE001 (no tokenizer.json, or one the library cannot read)
        return None
    return tuple(sorted(tokenizer.get_vocab(with_added_tokens=True).items()))


def same_vocabulary(a: Model, b: Model) -> bool | None:
    """Whether two servables map the same strings to the same ids; None where one cannot be read."""
    va, vb = _vocabulary(a.path, a.manifest_sha256), _vocabulary(b.path, b.manifest_sha256)
    return None if va is None or vb is None else va == vb


def choose_draft(setting: str, model: Model, catalog: list[Model]) -> tuple[Model | None, str]:
    """(the draft model for ``model``, or None and why) under SWARM_SERVE_DRAFT_MODEL=``setting``."""
    if setting == AUTO:
        fits = [m for m in catalog if m.available and m.model_id != model.model_id and m.export != "adapters"
                and m.architecture == model.architecture and 0 < m.parameters < model.parameters]
        fits = [m for m in sorted(fits, key=lambda m: (m.parameters, m.model_id)) if same_vocabulary(m, model)]
        if not fits:
            return None, (f"no draft model: SWARM_SERVE_DRAFT_MODEL=auto found no smaller {model.architecture} "
                          f"servable with the vocabulary of {model.model_id} in the catalog")
        return fits[0], ""
    found = next((m for m in catalog if m.model_id == setting), None)
    if found is None or not found.available:
        why = "is not in the catalog" if found is None else f"is not servable ({found.reason})"
        return None, f"no draft model: SWARM_SERVE_DRAFT_MODEL={setting!r} {why}"
    if found.model_id == model.model_id:
        return None, f"no draft model: SWARM_SERVE_DRAFT_MODEL={setting!r} is the served model itself"
    if same_vocabulary(found, model) is False:
        return None, (f"no draft model: {setting!r} does not share the vocabulary of {model.model_id} "
                      f"(a draft model must map the same strings to the same ids)")
    return found, ""
