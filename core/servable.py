"""The servable model format: `<model>/servable.json`, its shards and tokenizer, read torch-free."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Literal

import msgspec

FORMAT_VERSION = "1.0"
MANIFEST_NAME = "servable.json"
TOKENIZER_DIR = "tokenizer"
SHARD_FILE = "weights.safetensors"
LEGACY_SHARD_FILE = "weights.pt"
# Tensors of a learned boundary codec live in the shards but are not model parameters.
CODEC_PREFIX = "bottleneck."


class ServableError(ValueError):
    """A servable that cannot be used; the message is one line and names the reason."""


class NoCompressor(msgspec.Struct, frozen=True, tag="none", tag_field="kind"):
    """The boundary sends the full hidden state."""


class BottleneckCompressor(msgspec.Struct, frozen=True, tag="bottleneck", tag_field="kind"):
    """A linear bottleneck: the sender's shard holds the encoder half, the receiver's the decoder.

    ``file`` is the sender's shard (relative to the model dir); ``error`` is the relative
    reconstruction error, sum((h - ĥ)²) / sum(h²), measured on held-out calibration activations.
    """

    dim: int
    file: str
    error: float


class QuantizerCompressor(msgspec.Struct, frozen=True, tag="quantizer", tag_field="kind"):
    bits: int = 8


Compressor = NoCompressor | BottleneckCompressor | QuantizerCompressor


class ShardFile(msgspec.Struct, frozen=True):
    path: str  # relative to the model dir
    sha256: str
    bytes: int


class Shard(msgspec.Struct, frozen=True):
    stage: int
    files: list[ShardFile]


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling defaults the leader fills into a request that leaves them out."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    min_p: float = 0.0
    eos_token_ids: list[int] = []  # end-of-turn and end-of-text ids; any of them stops a reply
    max_new_tokens: int = 512


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format_version: str = FORMAT_VERSION
    model_id: str
    architecture: str
    config: dict  # the HF config.json, verbatim
    num_stages: int
    boundaries: list[list[int]] | None = None  # [first, last) layers per stage; None before XL2
    compressors: list[Compressor] = []  # one per internal boundary; empty means all "none"
    base: str | None = None  # path or id under SWARM_FELLOW_MODEL_CACHE
    quantization: dict | None = None
    export: Literal["full", "adapters"] = "full"
    adapter_config: dict | None = None  # PEFT's adapter_config.json for export "adapters"
    generation: Generation = Generation()
    chat_template: str = ""
    shards: list[Shard] = []
    pieces: dict[str, int] = {}  # embed_tokens / norm / lm_head -> the shard that holds it

    @property
    def num_layers(self) -> int:
        return int(self.config.get("num_hidden_layers", 0))

    @property
    def hidden_size(self) -> int:
        return int(self.config.get("hidden_size", 0))

    @property
    def size_bytes(self) -> int:
        return sum(f.bytes for s in self.shards for f in s.files)

    def stage_ranges(self) -> list[tuple[int, int]]:
        """The [first, last) layers of each exported shard."""
        if self.boundaries is not None:
            return [(a, b) for a, b in self.boundaries]
        return even_boundaries(self.num_layers, self.num_stages)

    def compressor(self, boundary: int) -> Compressor:
        """The codec on internal boundary ``boundary`` (between shard b and b + 1)."""
        return self.compressors[boundary] if boundary < len(self.compressors) else NoCompressor()


class _Version(msgspec.Struct):
    format_version: str = FORMAT_VERSION


def even_boundaries(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split layers as evenly as possible; earlier stages take the remainder."""
    if num_stages < 1 or num_stages > max(num_layers, 1):
        raise ServableError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    ranges, first = [], 0
    for i in range(num_stages):
        last = first + base + (1 if i < extra else 0)
        ranges.append((first, last))
        first = last
    return ranges


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_manifest(manifest: Manifest, model_dir: str | Path) -> Path:
    path = Path(model_dir) / MANIFEST_NAME
    path.write_bytes(msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n")
    return path


def is_servable_dir(value: str) -> bool:
    """Whether ``value`` names a folder holding a servable's manifest (not a model id)."""
    return (Path(value).expanduser() / MANIFEST_NAME).is_file()


def load_manifest(model_dir: str | Path) -> Manifest:
    """Read and validate ``<model_dir>/servable.json`` against the files beside it."""
    model_dir = Path(model_dir)
    path = model_dir / MANIFEST_NAME
    if not path.is_file():
        raise ServableError(f"{model_dir}: no {MANIFEST_NAME}")
    raw = path.read_bytes()
    try:
        version = msgspec.json.decode(raw, type=_Version).format_version
    except msgspec.DecodeError as exc:
        raise ServableError(f"{path}: not valid JSON ({_one_line(exc)})") from None
    major = version.split(".", 1)[0]
    if major != FORMAT_VERSION.split(".", 1)[0]:
        raise ServableError(f"{path}: format_version {version!r} is not supported (this reader knows {FORMAT_VERSION})")
    try:
        manifest = msgspec.json.decode(raw, type=Manifest)
    except msgspec.DecodeError as exc:
        raise ServableError(f"{path}: {_one_line(exc)}") from None
    if not manifest.shards:
        manifest = msgspec.structs.replace(manifest, shards=_legacy_shards(model_dir, manifest.num_stages))
    _validate(manifest, model_dir)
    return manifest


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _legacy_shards(model_dir: Path, num_stages: int) -> list[Shard]:
    """Old exports list no shards: find each stage's file by convention (sizes only, no hash)."""
    shards = []
    for stage in range(num_stages):
        folder = model_dir / "shards" / f"stage-{stage}"
        found = [folder / n for n in (SHARD_FILE, LEGACY_SHARD_FILE) if (folder / n).is_file()]
        files = [ShardFile(str(f.relative_to(model_dir)), "", f.stat().st_size) for f in found[:1]]
        shards.append(Shard(stage=stage, files=files))
    return shards


def _validate(m: Manifest, model_dir: Path) -> None:
    where = model_dir / MANIFEST_NAME
    if m.num_stages < 1:
        raise ServableError(f"{where}: num_stages must be at least 1, not {m.num_stages}")
    if m.num_layers < 1 or m.hidden_size < 1:
        raise ServableError(f"{where}: config lacks num_hidden_layers or hidden_size")
    if len(m.shards) != m.num_stages:
        raise ServableError(f"{where}: {len(m.shards)} shards listed for {m.num_stages} stages")
    if m.boundaries is not None:
        flat = [x for r in m.boundaries for x in r]
        contiguous = all(len(r) == 2 and r[0] < r[1] for r in m.boundaries) and all(
            m.boundaries[i][1] == m.boundaries[i + 1][0] for i in range(len(m.boundaries) - 1))
        if len(m.boundaries) != m.num_stages or not contiguous or flat[0] != 0 or flat[-1] != m.num_layers:
            raise ServableError(
                f"{where}: boundaries {m.boundaries} do not split {m.num_layers} layers into {m.num_stages} stages")
    if m.compressors and len(m.compressors) != m.num_stages - 1:
        raise ServableError(f"{where}: {len(m.compressors)} compressors for {m.num_stages - 1} internal boundaries")
    if m.export == "adapters" and not m.base:
        raise ServableError(f"{where}: export 'adapters' needs a base checkpoint")
    for shard in m.shards:
        if not shard.files:
            raise ServableError(f"{model_dir}: stage {shard.stage} has no shard file")
        for f in shard.files:
            file = model_dir / f.path
            if not file.is_file():
                raise ServableError(f"{model_dir}: missing shard file {f.path}")
            if file.stat().st_size != f.bytes:
                raise ServableError(f"{model_dir}: {f.path} is {file.stat().st_size} bytes, manifest says {f.bytes}")
    if not (model_dir / TOKENIZER_DIR).is_dir():
        raise ServableError(f"{model_dir}: missing {TOKENIZER_DIR}/")


def verify_checksums(m: Manifest, model_dir: str | Path) -> None:
    """Hash every shard file (slow on big models, so load_manifest leaves it out)."""
    for shard in m.shards:
        for f in shard.files:
            if f.sha256 and sha256_file(Path(model_dir) / f.path) != f.sha256:
                raise ServableError(f"{model_dir}: {f.path} does not match its sha256")


def resolve_base(base: str | None, model_cache: str | Path | None = None) -> Path | None:
    """The base checkpoint's folder: a path as given, else an id under SWARM_FELLOW_MODEL_CACHE, else
    where a fellow keeps a base it fetched from the leader (fetched_base_dir)."""
    if not base:
        return None
    if Path(base).expanduser().is_dir():
        return Path(base).expanduser()
    if model_cache is None:
        from core.settings import Settings

        model_cache = Settings.from_env().fellow.model_cache
    for candidate in ([] if Path(base).expanduser().is_absolute() else [Path(model_cache) / base]) + [
            fetched_base_dir(base, model_cache)]:
        if candidate.is_dir():
            return candidate
    return None


def fetched_base_dir(base: str, model_cache: str | Path) -> Path:
    """Where a fellow unpacks a base checkpoint it fetched: named by the base's last part and a hash of
    the whole (a path on the leader's machine, or an id), under the model cache's ``bases``."""
    digest = hashlib.sha256(base.encode()).hexdigest()[:12]
    return Path(model_cache) / "bases" / f"{Path(base).name or 'base'}-{digest}"


def safetensors_shapes(path: str | Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header: 8-byte little-endian length, then JSON."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def _count(shapes: dict[str, list[int]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def param_count(model_dir: str | Path, model_cache: str | Path | None = None) -> int:
    """Parameters the served model holds, without torch.

    From the base checkpoint's safetensors headers when the base is on disk; else, for a full
    export, from its shards' headers (codec tensors and a tied head's copy left out); else
    12 × layers × hidden². An adapters-only export is never sized by its few-MB shards.
    """
    m = load_manifest(model_dir)
    base = resolve_base(m.base, model_cache)
    base_files = sorted(base.glob("*.safetensors")) if base else []
    if base_files:
        return sum(_count(safetensors_shapes(f)) for f in base_files)
    files = [Path(model_dir) / f.path for s in m.shards for f in s.files]
    if m.export == "full" and files and all(f.suffix == ".safetensors" for f in files):
        tied = bool(m.config.get("tie_word_embeddings", False))
        total = 0
        for f in files:
            shapes = safetensors_shapes(f)
            total += _count({k: v for k, v in shapes.items()
                             if not k.startswith(CODEC_PREFIX) and not (tied and k == "lm_head.weight")})
        return total
    return 12 * m.num_layers * m.hidden_size**2
