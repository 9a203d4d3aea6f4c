"""`swarm export`: turn a local HF causal-LM checkpoint (or LoRA adapters over one) into a servable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.servable import (
    SHARD_FILE,
    TOKENIZER_DIR,
    BottleneckCompressor,
    Compressor,
    Generation,
    Manifest,
    NoCompressor,
    ServableError,
    Shard,
    ShardFile,
    even_boundaries,
    save_manifest,
    sha256_file,
)
from fellow.runtime.model.fused import unserved_kinds
from fellow.runtime.model.load.checkpoint import Checkpoint, read_config
from fellow.runtime.tools.bottleneck import codec_error, codec_tensors, fit_pca
from fellow.runtime.tools.calibration import boundary_activations, calibration_sequences

_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>")


def export(hf_dir: str | Path, out_dir: str | Path, stages: int = 1, boundaries: list[list[int]] | None = None,
           bottleneck: int | None = None, adapters: str | Path | None = None, *, model_id: str | None = None,
           base_id: str | None = None, calibration: list[str] | None = None, calib_seq_len: int = 256,
           calib_sequences: int = 48) -> Manifest:
    """Write ``out_dir`` as a servable split over ``stages`` and return its manifest.

    ``boundaries`` ([first, last) per stage) overrides the even split. ``bottleneck`` fits a PCA
    codec of that width on every internal boundary from ``calibration`` texts (default: the
    stdlib's pydoc topics); the last quarter of the sequences is held out to measure its error.
    ``adapters`` (a PEFT folder) exports only the LoRA weights, with ``hf_dir`` (or ``base_id``,
    an id under SWARM_FELLOW_MODEL_CACHE) recorded as the base.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config = read_config(hf_dir)
    if why := unserved_kinds(config.get("layer_types") or [], config.get("model_type")):
        raise ServableError(f"{hf_dir}: {why}")
    ranges = _ranges(config, stages, boundaries)
    source = Checkpoint(adapters, prefix="base_model.model.") if adapters else Checkpoint(hf_dir)
    staging = _fresh_staging(out_dir)
    codecs = _fit_codecs(hf_dir, adapters, ranges, bottleneck, calibration, calib_seq_len, calib_sequences)
    compressors: list[Compressor] = []
    shards = []
    for stage, (first, last) in enumerate(ranges):
        tensors = _stage_tensors(source, stage, len(ranges), first, last, tied=not adapters)
        if stage > 0 and codecs:
            tensors.update(codecs[stage - 1][1])
        if stage < len(ranges) - 1 and codecs:
            tensors.update(codecs[stage][0])
        rel = f"shards/stage-{stage}/{SHARD_FILE}"
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(staging / rel), metadata={"format": "pt"})
        size = (staging / rel).stat().st_size
        shards.append(Shard(stage=stage, files=[ShardFile(rel, sha256_file(staging / rel), size)]))
        if stage < len(ranges) - 1:
            compressors.append(BottleneckCompressor(dim=bottleneck, file=rel, error=codecs[stage][2])
                               if codecs else NoCompressor())
    tokenizer = _save_tokenizer(Path(adapters) if adapters else hf_dir, hf_dir, staging / TOKENIZER_DIR)
    manifest = Manifest(
        model_id=model_id or out_dir.name,
        architecture=(config.get("architectures") or [config.get("model_type", "")])[0],
        config=config,
        num_stages=len(ranges),
        boundaries=[list(r) for r in ranges],
        compressors=compressors,
        base=(base_id or str(hf_dir.resolve())) if adapters else None,
        quantization=config.get("quantization_config"),
        export="adapters" if adapters else "full",
        adapter_config=json.loads((Path(adapters) / "adapter_config.json").read_text()) if adapters else None,
        generation=_generation(hf_dir, config, tokenizer),
        chat_template=tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else "",
        shards=shards,
        pieces={"embed_tokens": 0, "norm": len(ranges) - 1, "lm_head": len(ranges) - 1},
    )
    save_manifest(manifest, staging)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return manifest


def _ranges(config: dict, stages: int, boundaries: list[list[int]] | None) -> list[tuple[int, int]]:
    layers = int(config["num_hidden_layers"])
    if boundaries is None:
        return even_boundaries(layers, stages)
    ranges = [(int(a), int(b)) for a, b in boundaries]
    if ranges[0][0] != 0 or ranges[-1][1] != layers or any(a >= b for a, b in ranges) or any(
            ranges[i][1] != ranges[i + 1][0] for i in range(len(ranges) - 1)):
        raise ServableError(f"boundaries {boundaries} do not split {layers} layers into contiguous stages")
    return ranges


def _fresh_staging(out_dir: Path) -> Path:
    """Write beside the target and rename at the end, so a failed export leaves no half servable."""
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "servable.json").exists():
        raise ServableError(f"{out_dir} exists and is not a servable; refusing to overwrite it")
    staging = out_dir.with_name(out_dir.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def _stage_tensors(source: Checkpoint, stage: int, num_stages: int, first: int, last: int,
                   tied: bool) -> dict[str, torch.Tensor]:
    """This stage's tensors, layer keys renamed relative to ``first`` so the shard loads alone."""
    return source.read_stage(first, last, is_first=stage == 0, is_last=stage == num_stages - 1, renumber_from=first,
                             copy_tied_head=tied)


def _fit_codecs(hf_dir: Path, adapters, ranges, dim: int | None, texts, seq_len: int, sequences: int):
    """Per internal boundary: (sender tensors, receiver tensors, held-out relative error)."""
    if not dim or len(ranges) < 2:
        return []
    model, tokenizer = _calibration_model(hf_dir, adapters)
    seqs = calibration_sequences(tokenizer, texts, seq_len, sequences)
    held = max(1, len(seqs) // 4)
    cuts = [last for _, last in ranges[:-1]]
    fit_acts = boundary_activations(model, seqs[:-held], cuts)
    held_acts = boundary_activations(model, seqs[-held:], cuts)
    dtype = _stored_dtype(hf_dir)
    out = []
    for cut in cuts:
        weight, mean = fit_pca(fit_acts[cut], dim)
        send, recv = codec_tensors(weight, mean, dtype)
        out.append((send, recv, codec_error(weight, mean, held_acts[cut], dtype)))
    return out


def _stored_dtype(hf_dir: Path) -> torch.dtype:
    """The codec is stored in the checkpoint's dtype, and its error measured after that rounding."""
    config = read_config(hf_dir)
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _calibration_model(hf_dir: Path, adapters):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    if adapters:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapters)).merge_and_unload()
    return model.eval(), AutoTokenizer.from_pretrained(str(adapters if _has_tokenizer(adapters) else hf_dir))


def _has_tokenizer(folder) -> bool:
    return bool(folder) and any((Path(folder) / n).is_file() for n in ("tokenizer.json", "tokenizer.model"))


def _save_tokenizer(preferred: Path, fallback: Path, target: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(preferred if _has_tokenizer(preferred) else fallback))
    tokenizer.save_pretrained(str(target))
    return tokenizer


def _generation(hf_dir: Path, config: dict, tokenizer) -> Generation:
    """Sampling defaults from generation_config.json; every end-of-turn id the tokenizer knows."""
    path = hf_dir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    eos: list[int] = []
    for source in (gen.get("eos_token_id"), config.get("eos_token_id"), tokenizer.eos_token_id):
        eos += source if isinstance(source, list) else [source] if isinstance(source, int) else []
    vocab = tokenizer.get_vocab()
    eos += [vocab[t] for t in _END_OF_TURN if t in vocab]
    defaults = Generation()
    return Generation(
        temperature=float(gen.get("temperature", defaults.temperature)),
        top_p=float(gen.get("top_p", defaults.top_p)),
        top_k=int(gen.get("top_k", defaults.top_k)),
        min_p=float(gen.get("min_p") or defaults.min_p),
        eos_token_ids=list(dict.fromkeys(eos)),
        max_new_tokens=int(gen.get("max_new_tokens") or defaults.max_new_tokens),
    )
