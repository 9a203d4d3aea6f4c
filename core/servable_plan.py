"""Which shards a serving stage reads, and which codec sits on each of its boundaries."""

from __future__ import annotations

import msgspec

from core.servable import Compressor, Manifest, NoCompressor, ServableError, even_boundaries


class StagePlan(msgspec.Struct, frozen=True, kw_only=True):
    """What serving stage ``stage`` of ``num_stages`` loads and how its boundaries are coded."""

    stage: int
    num_stages: int
    layers: tuple[int, int]  # [first, last) absolute layer indices
    shards: list[int]  # exported shards whose layers overlap ``layers``
    recv: Compressor  # codec on the boundary before this stage (none for stage 0)
    send: Compressor  # codec on the boundary after this stage (none for the last)
    # cuts training made inside this stage's layers, as (the first layer after the cut, its codec), where
    # the codec is a learned bottleneck or a fixed quantizer: applied where they were trained
    inner: list[tuple[int, Compressor]] = []

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


def serving_ranges(manifest: Manifest, num_stages: int | None = None) -> list[tuple[int, int]]:
    """Layer ranges for serving over ``num_stages`` (the exported count by default).

    Served with as many stages as exported, the split is the recorded one. With another count
    the layers are split evenly, which needs recorded boundaries: an export without them only
    says what its own stages hold, so any other count is refused.
    """
    n = manifest.num_stages if num_stages is None else num_stages
    if n == manifest.num_stages:
        return manifest.stage_ranges()
    if manifest.boundaries is None:
        raise ServableError(
            f"{manifest.model_id} records no boundaries, so it serves only over the "
            f"{manifest.num_stages} stage(s) it was exported with, not {n}")
    return even_boundaries(manifest.num_layers, n)


def _codec_at(manifest: Manifest, layer: int) -> Compressor:
    """A trained boundary's codec where a serving cut falls on it; elsewhere uncompressed."""
    trained = manifest.stage_ranges()
    for b in range(len(trained) - 1):
        if trained[b][1] == layer:
            return manifest.compressor(b)
    return NoCompressor()


def plan_stage(manifest: Manifest, stage: int, num_stages: int | None = None) -> StagePlan:
    ranges = serving_ranges(manifest, num_stages)
    n = len(ranges)
    if not 0 <= stage < n:
        raise ServableError(f"stage {stage} is out of range for {n} stage(s)")
    first, last = ranges[stage]
    overlap = [i for i, (a, b) in enumerate(manifest.stage_ranges()) if a < last and first < b]
    return StagePlan(
        stage=stage,
        num_stages=n,
        layers=(first, last),
        shards=sorted(set(overlap) | _piece_shards(manifest, stage == 0, stage == n - 1)),
        recv=_codec_at(manifest, first) if stage > 0 else NoCompressor(),
        send=_codec_at(manifest, last) if stage < n - 1 else NoCompressor(),
        inner=inner_boundaries(manifest, first, last),
    )


def inner_boundaries(manifest: Manifest, first: int, last: int) -> list[tuple[int, Compressor]]:
    """The trained cuts strictly inside layers [first, last) that code what crosses them (a serving stage
    over several trained stages keeps its bottlenecks, the spec's _inner_boundaries)."""
    trained = manifest.stage_ranges()
    cuts = [(trained[b][1], manifest.compressor(b)) for b in range(len(trained) - 1)]
    return [(layer, codec) for layer, codec in cuts if first < layer < last and not isinstance(codec, NoCompressor)]


def _piece_shards(manifest: Manifest, first: bool, last: bool) -> set[int]:
    wanted = (["embed_tokens"] if first else []) + (["norm", "lm_head"] if last else [])
    default = {"embed_tokens": 0, "norm": manifest.num_stages - 1, "lm_head": manifest.num_stages - 1}
    return {manifest.pieces.get(p, default[p]) for p in wanted}
