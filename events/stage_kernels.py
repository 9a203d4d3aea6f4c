"""How a loaded stage computes, as its status shows it: one typed report a stage keeps (``StageModel.kernels``)
and sends with its ready report (``ReadyReport``), which its fellow publishes on ``StageReady`` and the leader
keeps in the stage's row (``stages.kernels``, as JSON).

A stage writes it only through ``StageModel.note``; each field says which module notes it. Fields left unset
are left out of the JSON, so a status shows what was measured or chosen and nothing else. The reports nested
inside (a kernel chooser's timings, a compile's findings) stay as their producers build them.
"""

from __future__ import annotations

import msgspec


class StageKernels(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How a stage computes, for the load's status."""

    path: str = ""  # fused, hf or hf+onednn (model/load/kernels.prepare_stage); "hf" until then
    why: str | None = None  # why its layers are not fused
    # the kernel chooser's (load/kernels.KernelChooser.summary): row counts timed, seconds spent, and per weight
    # shape (out x in) the kernel chosen and its ms at each row count
    rows: list[int] | None = None
    seconds: float | None = None
    shapes: dict[str, dict] | None = None
    head: str | None = None  # a quantized stage's head kernel, or "float"
    int8_rows: str | None = None  # what multiplies its int8 weights in decode steps (quant/int8_gemv)
    lora: dict | None = None  # adapters kept apart: mode, modules, and their step_ms once measured (server/base)
    attention: str | None = None  # the HF layers' attention (SWARM_SERVE_ATTENTION), or "fused"
    fourbit_rows: dict | None = msgspec.field(default=None, name="4bit_rows")  # load/fourbit_rows
    inner: dict[str, str] | None = None  # cuts trained inside the stage, by layer (model/boundary)
    compiled: dict | None = None  # what the compile found or why not (forms/plan_steps, forms/background_compile)
    cuda_graphs: dict | None = None  # what CUDA-graph replay found (forms/cuda_graphs)
    devices: list[dict] | None = None  # a stage split over devices (load/device_split)
    half_storage: dict | None = None  # per device, the upcast's timings and verdict (load/half_storage)
    recurrent: dict | None = None  # a recurrent stage's layers and what it serves without (model/recurrent)
    kv: dict | None = None  # the KV budget measured, planned, most and held (server/base)
    draft_decoder: str | None = None  # the draft model's decoder, where it drafts (server/base)
    draft_upcast: dict | None = None  # ... and where its half-precision layers compute upcast
    step_ms: dict[str, float] | None = None  # the decode step's ms by batch size, measured before ready
    step_costs: dict | None = None  # the spec's step costs (SWARM_SERVE_STEP_COSTS, load/step_report)
    link_probe: dict | None = None  # stage 0 of a ring: trips round the ring (ring/servers)
    ring: dict | None = None  # stage 0 of a ring: in flight and groups, as sized from steps and links (ring/servers)


def as_json(kernels: StageKernels) -> dict:
    """What the stage's row and the status hold."""
    return msgspec.to_builtins(kernels)
