"""Read a local HF causal-LM checkpoint tensor by tensor, and name each tensor's piece of the model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from core.servable import ServableError

# Qwen2/Qwen3/Qwen3-MoE/Llama/Mistral all lay their weights out this way.
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PIECES = {"model.embed_tokens.": "embed_tokens", "model.norm.": "norm", "lm_head.": "lm_head"}
_IGNORED = re.compile(r"(^|\.)rotary_emb\.")  # recomputed from the config, never trained
# Qwen3-Next's multi-token prediction head: transformers does not load it, and no stage serves it
_UNSERVED = re.compile(r"^mtp\.")
# a mixture of experts' MLP as checkpoints store it: one module per expert
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def merge_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert MLP weights (``...mlp.experts.<e>.gate_proj.weight``, as Qwen3-MoE checkpoints hold
    them) in the layout transformers' modules hold them: ``...mlp.experts.gate_up_proj`` [E, 2I, H]
    (each expert's gate rows, then its up rows) and ``...mlp.experts.down_proj`` [E, H, I], as
    transformers converts them when it loads the checkpoint. Other tensors pass unchanged."""
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if match := _EXPERT.match(name):
            prefix, index, kind = match.group(1), int(match.group(2)), match.group(3)
            experts.setdefault(prefix, {}).setdefault(kind, {})[index] = tensor
        else:
            out[name] = tensor
    for prefix, kinds in experts.items():
        count = len(kinds.get("gate", {}))
        if any(sorted(kinds.get(kind, {})) != list(range(count)) for kind in ("gate", "up", "down")):
            raise ServableError(f"{prefix}: expert weights are not gate, up and down for experts 0..{count - 1}")
        stacked = {kind: torch.stack([kinds[kind][e] for e in range(count)]) for kind in ("gate", "up", "down")}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stacked["gate"], stacked["up"]], dim=1).contiguous()
        out[f"{prefix}.down_proj"] = stacked["down"].contiguous()
    return out


def classify(key: str) -> tuple[str, int | None, str] | None:
    """(piece, layer index or None, name inside the piece) for a checkpoint key; None to skip.

    ``model.layers.3.mlp.up_proj.weight`` -> ("layers", 3, "mlp.up_proj.weight");
    ``lm_head.weight`` -> ("lm_head", None, "weight").
    """
    if _IGNORED.search(key) or _UNSERVED.match(key):
        return None
    if match := _LAYER.match(key):
        return "layers", int(match.group(1)), match.group(2)
    for prefix, piece in _PIECES.items():
        if key.startswith(prefix):
            return piece, None, key[len(prefix):]
    raise ServableError(f"checkpoint tensor {key!r} is not part of a Qwen/Llama/Mistral causal LM")


class Checkpoint:
    """The tensors of a checkpoint folder (one safetensors file, an index of several, or .bin)."""

    def __init__(self, folder: str | Path, prefix: str = ""):
        self.folder = Path(folder)
        self.prefix = prefix  # stripped from every key (PEFT writes "base_model.model.")
        self._bin: dict[Path, dict[str, torch.Tensor]] = {}  # .bin files load whole, so keep them
        self._where = self._locate()

    def _locate(self) -> dict[str, Path]:
        index = next(iter(sorted(self.folder.glob("*.safetensors.index.json"))), None)
        if index is not None:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {k: self.folder / f for k, f in weight_map.items()}
        files = sorted(self.folder.glob("*.safetensors")) or sorted(self.folder.glob("*.bin"))
        if not files:
            raise ServableError(f"{self.folder}: no safetensors or .bin weights")
        where: dict[str, Path] = {}
        for f in files:
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt") as fh:
                    where.update({k: f for k in fh.keys()})
            else:
                where.update({k: f for k in self._load_bin(f)})
        return where

    def _load_bin(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._bin:
            self._bin[path] = torch.load(path, map_location="cpu", weights_only=True)
        return self._bin[path]

    def keys(self) -> list[str]:
        """Keys with ``prefix`` stripped."""
        return [k[len(self.prefix):] if k.startswith(self.prefix) else k for k in self._where]

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Load just these tensors, opening each file once."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            path, full = self.locate(key)
            by_file.setdefault(path, []).append(full)
        out: dict[str, torch.Tensor] = {}
        for path, fulls in by_file.items():
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as fh:
                    loaded = {k: fh.get_tensor(k) for k in fulls}
            else:
                loaded = {k: self._load_bin(path)[k] for k in fulls}
            out.update({(k[len(self.prefix):] if k.startswith(self.prefix) else k): t for k, t in loaded.items()})
        return out

    def locate(self, key: str) -> tuple[Path, str]:
        """(file, full key) of a tensor, by its key with or without ``prefix``."""
        full = key if key in self._where else self.prefix + key
        if full not in self._where:
            raise ServableError(f"{self.folder}: no tensor {key!r}")
        return self._where[full], full

    def stage_names(self, first: int, last: int, *, is_first: bool, is_last: bool,
                    renumber_from: int = 0) -> dict[str, str]:
        """Checkpoint key -> stage name of one stage's tensors: layers [first, last) as
        ``layers.<index - renumber_from>.<name>``, the embeddings when ``is_first``, the norm and head
        when ``is_last``."""
        wanted: dict[str, str] = {}
        for key in self.keys():
            kind = classify(key)
            if kind is None:
                continue
            piece, layer, name = kind
            if piece == "layers" and first <= layer < last:
                wanted[key] = f"layers.{layer - renumber_from}.{name}"
            elif (piece == "embed_tokens" and is_first) or (piece in ("norm", "lm_head") and is_last):
                wanted[key] = f"{piece}.{name}"
        return wanted

    def read_stage(self, first: int, last: int, *, is_first: bool, is_last: bool, renumber_from: int = 0,
                   copy_tied_head: bool = True) -> dict[str, torch.Tensor]:
        """One stage's tensors, named as ``stage_names`` names them, a mixture of experts' weights merged
        as its modules hold them (``merge_experts``). A last stage of a checkpoint with tied embeddings
        gets its own copy of the head (``copy_tied_head``) rather than stage 0's."""
        wanted = self.stage_names(first, last, is_first=is_first, is_last=is_last, renumber_from=renumber_from)
        tensors = merge_experts({wanted[k]: t.contiguous() for k, t in self.read(list(wanted)).items()})
        if copy_tied_head and is_last and "lm_head.weight" not in tensors:
            tensors["lm_head.weight"] = self.read(["model.embed_tokens.weight"])["model.embed_tokens.weight"].clone()
        return tensors


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ServableError(f"{folder}: no config.json (not a Hugging Face checkpoint)")
    return json.loads(path.read_text())
