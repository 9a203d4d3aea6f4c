"""A load's weight quantization, torch-free: what a request may ask, what each fellow must declare to
serve it, and what it costs per base parameter. The leader, the CLI and the stage read it alike.

A request names one of four methods:

- ``{"method": "none"}``: the weights at the stage's compute dtype;
- ``{"method": "nf4"}`` (or ``{"bits": 4}``): bitsandbytes NF4, on a fellow declaring CAP_QUANTIZED;
- ``{"bits": 8}`` (or ``{"method": "int8"}``): int8 weight-only. On a CPU fellow torch's own int8 kernel
  (CAP_CPU_INT8); on a GPU bitsandbytes' (CAP_QUANTIZED);
- ``{"method": "int4-fast"}`` (or ``{"backend": "torchao"}``): packed int4 weight-only kernels. On a
  CPU fellow torch's own int4 kernel (CAP_CPU_INT4); on a GPU torch's CUDA int4 kernel (tinygemm, the one
  torchao's int4 weight-only tile-packed layout calls), on Ampere or newer (CAP_INT4_FAST). With too few
  such fellows the load stays 4-bit as NF4; a stage whose card cannot run it after all reloads as NF4.
"""

from __future__ import annotations

from events.fellow import CAP_CPU_INT4, CAP_CPU_INT8, CAP_INT4_FAST, CAP_QUANTIZED

NONE, NF4, INT8, INT4_FAST = "none", "nf4", "int8", "int4-fast"
METHODS = (NONE, NF4, INT8, INT4_FAST)

# Bytes per parameter of the base checkpoint, as the spec prices them.
PRICE_4BIT = 0.55
PRICE_8BIT = 1.05
PRICE = {NF4: PRICE_4BIT, INT4_FAST: PRICE_4BIT, INT8: PRICE_8BIT}
BITS = {NONE: None, NF4: 4, INT4_FAST: 4, INT8: 8}
# SWARM_SERVE_LORA: how a quantized stage serves adapters it keeps apart: lean (one addmm, float32), lean16
# (A and B in half precision, the product rounded there) or peft (PEFT's own LoRA layers)
LORA_MODES = ("lean", "lean16", "peft")

_KEYS = {"method", "bits", "backend"}
_ASKED = ('{"method": "none"}, {"method": "nf4"}, {"bits": 8}, {"method": "int4-fast"}')


# SWARM_SERVE_4BIT_ROWS: 4-bit calls of up to this many rows may be split; more (prompt pieces) never are
SPLIT_MAX_ROWS = 8


def fourbit_rows_value(raw: str | int) -> str | int | None:
    """SWARM_SERVE_4BIT_ROWS as the fellow and its stages read it: ``auto`` (also for empty), ``off``, or a
    row limit 1..SPLIT_MAX_ROWS as an int; None where it is none of those."""
    value = str(raw).strip().lower()
    if value in ("", "auto", "off"):
        return value or "auto"
    return int(value) if value.isdigit() and 1 <= int(value) <= SPLIT_MAX_ROWS else None


class QuantizationError(ValueError):
    """A quantization that no load serves; the message says what would be."""


def method_of(quantization: dict | None) -> str:
    """The method a request's ``quantization`` names (``none`` for None); QuantizationError when it names none."""
    if quantization is None:
        return NONE
    if not isinstance(quantization, dict):
        raise QuantizationError(f"quantization must be an object such as {_ASKED}")
    unknown = sorted(set(quantization) - _KEYS)
    if unknown:
        raise QuantizationError(f"quantization takes method, bits or backend, not {', '.join(unknown)}")
    method = quantization.get("method")
    bits = quantization.get("bits")
    backend = quantization.get("backend")
    if method is not None and not isinstance(method, str):
        raise QuantizationError(f"quantization.method must be a string, one of {', '.join(METHODS)}")
    if bits is not None and (isinstance(bits, bool) or bits not in (4, 8)):
        raise QuantizationError(f"quantization.bits must be 4 or 8, not {bits!r}")
    if backend is not None and backend not in ("torchao", "bitsandbytes"):
        raise QuantizationError(f"quantization.backend must be torchao or bitsandbytes, not {backend!r}")
    if method is None:
        if backend == "torchao":
            method = INT4_FAST
        elif bits is None:
            raise QuantizationError(f"quantization names no method: one of {_ASKED}")
        else:
            method = NF4 if bits == 4 else INT8
    method = method.lower()
    if method not in METHODS:
        raise QuantizationError(f"quantization method {method!r} is not served: one of {', '.join(METHODS)}")
    if bits is not None and BITS[method] != bits:
        raise QuantizationError(f"quantization method {method} is not {bits}-bit")
    if backend == "torchao" and method != INT4_FAST:
        raise QuantizationError("the torchao backend serves int4-fast only")
    return method


def manifest_method(quantization: dict | None) -> str:
    """The method a servable's manifest records (its HF ``quantization_config``, or one of ours); ``none``
    where it records none or one this project does not serve (the load then serves full precision)."""
    if not quantization:
        return NONE
    if quantization.get("quant_method") == "bitsandbytes":
        if quantization.get("load_in_4bit"):
            return NF4 if quantization.get("bnb_4bit_quant_type", "nf4") == "nf4" else NONE
        return INT8 if quantization.get("load_in_8bit") else NONE
    if quantization.get("quant_method") == "torchao":
        return INT4_FAST
    try:
        return method_of(quantization)
    except QuantizationError:
        return NONE


def as_request(method: str) -> dict:
    """The canonical request body for a method."""
    return {"bits": 8} if method == INT8 else {"method": method}


def capability_for(method: str, has_gpu: bool) -> str | None:
    """What a fellow must declare to serve ``method`` on its device (None: every fellow serves it)."""
    if method == NONE:
        return None
    if method == NF4:
        return CAP_QUANTIZED
    if method == INT8:
        return CAP_QUANTIZED if has_gpu else CAP_CPU_INT8
    return CAP_INT4_FAST if has_gpu else CAP_CPU_INT4


def bytes_per_param(method: str, has_gpu: bool) -> float:
    """What a stage takes per base parameter: the spec's price when quantized, else its compute dtype's
    (half precision on a GPU, float32 on a CPU)."""
    return PRICE.get(method) or (2.0 if has_gpu else 4.0)
