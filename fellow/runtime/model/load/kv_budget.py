"""What KV token budget a loaded stage can really hold, measured on its own devices after loading."""

from __future__ import annotations

import math
import os
from collections import defaultdict

import torch

from fellow.runtime.model.load.device_split import CUDA_KEEP_BYTES, CUDA_USABLE
from fellow.runtime.model.stage import StageModel

CPU_USABLE = 0.25  # a CPU stage shares its host with everything else on it
CPU_CAP_TOKENS = 131_072  # past this a CPU stage is far too slow for the context to matter
SCORE_BYTES = 4  # attention scores go through softmax in float32


def bytes_per_token(stage: StageModel, prefill_chunk: int) -> dict[torch.device, int]:
    """Per device: what one more token of context costs there.

    That is the keys and values of the layers on it, plus one prompt piece's attention scores
    against that token (one layer's at a time, every query head, every position of the piece).
    """
    element = torch.tensor([], dtype=stage.dtype).element_size()
    kv = defaultdict(int)
    attends = getattr(stage, "attends", None) or [True] * len(stage.layer_devices)
    for device, holds_keys in zip(stage.layer_devices, attends):  # a recurrent layer keeps no keys
        kv[device] += 2 * stage.num_kv_heads * stage.head_dim * element if holds_keys else 0
    piece = prefill_chunk if prefill_chunk > 0 else stage.config.max_position_embeddings
    scores = stage.config.num_attention_heads * piece * SCORE_BYTES
    return {device: layer_bytes + scores for device, layer_bytes in kv.items()}


def kv_tokens_for(free_bytes: int, token_bytes: int, *, usable: float, keep_bytes: int) -> int:
    return max(0, int((usable * free_bytes - keep_bytes) // token_bytes))


def cuda_free_bytes(device: torch.device) -> int:
    """The driver's free memory plus what torch's allocator holds cached but unused."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def cpu_free_bytes(limit: int = 0) -> int:
    """What this process may still take on the host: the host's available memory, or less where a memory
    limit holds the process: its cgroup's (v2 or v1), or ``limit`` (bytes for the whole process, set
    by its caller), less what the process holds already."""
    room = [_meminfo_available()]
    for cap, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                      ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap_bytes, used_bytes = _read_int(cap), _read_int(used)
        if cap_bytes is not None and used_bytes is not None and cap_bytes < 1 << 60:  # "max", or v1's no-limit
            room.append(cap_bytes - used_bytes)
            break
    if limit > 0:
        room.append(limit - resident_bytes())
    return max(0, min(room))


def resident_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # no such cgroup file, or "max"
        return None


def session_state_bytes(stage: StageModel) -> dict[torch.device, int]:
    """Per device: the fixed-size states one session keeps in the stage's recurrent (linear-attention)
    layers, whatever its length (fellow.runtime.model.recurrent); empty for a stage without such layers."""
    from fellow.runtime.model.recurrent import state_shapes

    states: dict[torch.device, int] = defaultdict(int)
    if getattr(stage, "recurrent", None) is None:
        return states
    element = torch.tensor([], dtype=stage.dtype).element_size()
    for layer, device, holds_keys in zip(stage.layers, stage.layer_devices, stage.attends):
        if not holds_keys:
            conv, state, _dtype, _device = state_shapes(layer, stage.dtype, device)
            states[device] += math.prod(conv) * element + math.prod(state) * 4  # recurrent states in float32
    return states


def measured_kv_tokens(stage: StageModel, prefill_chunk: int = 256, sessions: int = 0, memory_limit: int = 0,
                       keep_bytes: int = 0) -> int:
    """The stage's KV budget in tokens: the device that holds the fewest sets it. On a card, 85 % of what
    is free less 300 MiB (the spec's reserve); on the CPU a quarter of what the host or the process's
    memory limit leaves (cpu_free_bytes; ``memory_limit``: a limit its caller sets). ``sessions``: how
    many sessions it may hold at once; their fixed-size recurrent states (session_state_bytes) are kept
    free first, so the tokens are what is left. ``keep_bytes``: host memory the stage will take after it
    measures (its decode step compiling in the background), kept out of a CPU budget."""
    budgets = []
    states = session_state_bytes(stage)
    pieces = float32_piece_bytes(stage)
    for device, token_bytes in bytes_per_token(stage, prefill_chunk).items():
        held = sessions * states.get(device, 0)
        if device.type == "cuda":
            keep = card_keep_bytes(pieces.get(device, 0))
            budgets.append(kv_tokens_for(cuda_free_bytes(device), token_bytes,
                                         usable=CUDA_USABLE, keep_bytes=keep + held))
        else:
            tokens = kv_tokens_for(cpu_free_bytes(memory_limit), token_bytes, usable=CPU_USABLE,
                                   keep_bytes=held + keep_bytes)
            budgets.append(min(tokens, CPU_CAP_TOKENS))
    return min(budgets)


def float32_piece_bytes(stage: StageModel) -> dict[torch.device, int]:
    """Per card: the largest 4-bit weight there dequantized in float32, which a prompt piece holds while
    it computes in float32 (the spec's TS12: about 356 MB for Qwen3-14B's MLP); empty where the stage's
    prompt pieces stay in its own dtype (fourbit_rows' ``float32_prompt_pieces``)."""
    from fellow.runtime.model.load.fourbit_rows import stage_blocks

    if not (stage.kernels.fourbit_rows or {}).get("float32_prompt_pieces"):
        return {}
    out: dict[torch.device, int] = defaultdict(int)
    for block in stage_blocks(stage):
        for linear in block:
            device = linear.weight.device
            out[device] = max(out[device], linear.in_features * linear.out_features * 4)
    return out


def card_keep_bytes(float32_piece: int) -> int:
    """What a card keeps free besides its KV: room for a float32 prompt piece's dequantized weight, which
    replaces the 300 MiB kept for other passing buffers rather than adding to it (a stage runs one forward
    at a time)."""
    return max(CUDA_KEEP_BYTES, float32_piece)


def held_tokens(measured: int, planned: int, most: int = 0) -> int:
    """What a stage holds of what it measured: at most what placement planned, or grown past that up to
    ``most`` where placement set a ceiling (a full context per request in flight); nothing planned: all
    it measured."""
    if not planned:
        return measured
    return min(measured, max(planned, most))
