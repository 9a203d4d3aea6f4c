"""The one place a stage's decode forms are picked: ``plan_steps`` at load, ``background_for`` once it serves.

At load the stage's own eager forms are in its step table already (``eager_steps.eager_forms``: fused or HF
layers, recurrent or not, as ``kernels.prepare_stage`` loaded them). ``plan_steps`` adds what was asked or is
due: inductor's graphs compiled at load (SWARM_SERVE_COMPILE=1,8: ``compiled.compile_decode``), CUDA-graph
replay (SWARM_SERVE_CUDA_GRAPHS: ``cuda_graphs.graph_decode``), or, by default, says whether a whole CPU stage
compiles in the background; ``plan_draft_steps`` gives a draft model's stage its fixed-shape decoder.
``background_for`` gives the stage's server that compile (``BackgroundCompile``),
which puts the checked steps it finds into the table between two steps. Every decision is logged in the
stage's ``kernels``, which the load's status shows.
"""

from __future__ import annotations

import torch

from core.quantization import INT4_FAST, INT8, NONE
from events.stage import StageOptions
from fellow.runtime.model.forms.background_compile import BackgroundCompile, why_not_here
from fellow.runtime.model.forms.compiled import compile_decode, why_not
from fellow.runtime.model.forms.cuda_graphs import graph_decode
from fellow.runtime.model.forms.draft_graph import FixedDecoder, FixedStep
from fellow.runtime.model.quant.report import stage_weights


def compiles_in_background(options: StageOptions, num_stages: int, device: torch.device, quantization: str) -> bool:
    """Whether a stage so loaded may compile its step once it serves (SWARM_SERVE_COMPILE=auto, the default): a
    whole model on the CPU, in float32 or over the int8 and int4 kernels the graphs call as they are."""
    return (options.compile is None and num_stages == 1 and device.type == "cpu"
            and quantization in (NONE, INT8, INT4_FAST))


def plan_steps(stage, options: StageOptions, background: bool) -> None:
    """Fill the stage's step table at load, as ``options`` ask; ``background``: ``compiles_in_background``."""
    compile = options.compile
    if compile:
        stage.note(compiled=compile_decode(stage, compile, stage.plain_weights))
    elif compile is None and (why := why_not_here(stage, stage_weights(stage)[0]) if background else why_not(stage)
                              or "its plain weights were not kept"):
        stage.note(compiled={"asked": [1], "background": True, "why": why})
        background = False
    if not background:
        stage.take_plain_weights()  # the compiled step holds what it needs; else the stage's server takes them
    if options.cuda_graphs and (graphs := graph_decode(stage, slots=options.batch_cap)) is not None:  # off CUDA
        stage.note(cuda_graphs=graphs)


def plan_draft_steps(stage, decoder: FixedDecoder | None) -> None:
    """A draft model's stage: its fixed-shape decoder (``draft_graph.fixed_decoder``) serves the steps of
    sessions in its slots; None: every step eager."""
    stage.steps.put("cuda_graphs", FixedStep(decoder) if decoder is not None else None)


def background_for(stage, options: StageOptions) -> BackgroundCompile | None:
    """The compile a serving stage starts once it is ready, where ``plan_steps`` kept its plain weights for it;
    the stage lets them go (the compile holds them until it is done)."""
    if stage.plain_weights is None or options.compile is not None:
        return None
    background = BackgroundCompile(stage, stage.take_plain_weights())
    stage.note(compiled=background.report)
    return background
