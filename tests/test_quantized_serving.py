"""Quantized loads end to end (real leader, fellows, stage processes): a fellow that does not declare the
kernels gets the load in full precision and the status says why; one that does serves it quantized,
and the status shows the method and the measured weight bytes beside the estimate (int4-fast, int8 and
bitsandbytes' NF4). No stage serves another method than the one it was priced at."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.quantization import method_of
from tests.processes import SwarmProcess, wait_until
from tests.serving_fixtures import Stack, make_servable

MODEL = "tiny"


@pytest.fixture(scope="module")
def servables(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_servable(root, MODEL, layers=8, hidden=256, stages=1, seed=2)
    return root / "servables"


def status(stack: Stack) -> dict:
    r = stack.get(f"/api/v1/models/{MODEL}/status")
    assert r.status_code == 200, r.text
    return r.json()["load"]


def priced_as_served(load: dict) -> None:
    """Every stage serves the method it was priced at, and says so itself (StageReady.weights)."""
    placed = method_of(load["quantization"])
    for stage in load["stages"]:
        assert stage["weights"]["quantization"] == placed, load


def declares(stack: Stack, fellow_id: str, cap: str) -> bool:
    fellows = stack.get("/api/v1/fellows").json()["data"]
    return any(f["id"] == fellow_id and cap in f["capabilities"] for f in fellows)


def test_an_int8_load_asked_as_soon_as_the_stack_is_up_serves_int8(tmp_path, nats_server, servables):
    """A fellow is online only once its kernel probe has run (fellow.main.probe_first): a load asked the
    moment the stack is up (as `swarm up` reports it: every fellow online) is placed on its declared
    kernels and serves int8, not full precision."""
    stack = Stack(tmp_path, nats_server.url, servables, fellows=1, SWARM_SERVE_QUANTIZED="auto").start()
    try:
        load = stack.load(MODEL, quantization={"bits": 8})
        assert load["quantization"] == {"bits": 8}, load.get("quantization_reason")
        assert load["quantization_reason"] is None
        priced_as_served(load)
        [stage] = load["stages"]
        assert stage["weights"]["quantization"] == "int8"
        assert {e["kernel"] for e in stage["kernels"]["shapes"].values()} == {"int8"}
    finally:
        stack.stop()


def test_fallback_without_capable_fellows_then_quantized_on_one_that_declares_them(tmp_path, nats_server, servables):
    stack = Stack(tmp_path, nats_server.url, servables, fellows=1, SWARM_SERVE_QUANTIZED="off").start()
    capable = None
    try:
        # f0 declares no quantized kernel: an int4-fast load serves full precision, priced and shown as such
        load = stack.load(MODEL, quantization={"method": "int4-fast"})
        assert load["quantization"] == {"method": "none"}
        assert load["quantization_requested"] == {"method": "int4-fast"}
        assert "int4-fast asked, served in full precision" in load["quantization_reason"]
        assert "f0 does not declare serve-cpu-int4" in load["quantization_reason"]
        priced_as_served(load)
        [stage] = load["stages"]
        weights = stage["weights"]
        parameters = stack.get(f"/api/v1/models/{MODEL}").json()["parameters"]  # tied head once; the stage has a copy
        assert weights["estimate_bytes"] == 4 * parameters  # the float32 price, not 0.55
        assert weights["bytes"] >= weights["float_bytes"]
        assert stack.post(f"/api/v1/models/{MODEL}/unload").status_code == 200
        wait_until(lambda: stack.get(f"/api/v1/models/{MODEL}").json()["load_state"] == "unloaded", 60, "unloaded")

        # a fellow that probes its kernels declares them, and the same request is served int4 there
        env = {k: v for k, v in stack.env.items() if k != "SWARM_SERVE_QUANTIZED"}
        capable = SwarmProcess(["fellow", "--id", "f1"], env, tmp_path / "fellow1.log")
        capable.start()
        wait_until(lambda: declares(stack, "f1", "serve-cpu-int4"), 120, "f1 declares serve-cpu-int4")
        assert not declares(stack, "f0", "serve-cpu-int4")
        load = stack.load(MODEL, quantization={"method": "int4-fast"})
        assert load["quantization"] == {"method": "int4-fast"} and load["quantization_reason"] is None
        priced_as_served(load)
        [stage] = load["stages"]
        assert stage["fellow_id"] == "f1"
        weights = stage["weights"]
        assert weights["estimate_bytes"] == int(0.55 * parameters)
        assert weights["bytes"] <= 0.17 * weights["float_bytes"]  # embeddings and norms counted, in float32
        assert status(stack)["stages"][0]["weights"] == weights
        assert {e["kernel"] for e in stage["kernels"]["shapes"].values()} == {"int4"}
        assert stage["kernels"]["head"] == "int8"
        r = stack.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 8,
                                                "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
        # the same model asked at another quantization while loaded: a conflict, not a silent reuse
        r = stack.post(f"/api/v1/models/{MODEL}/load", {"quantization": {"bits": 8}})
        assert r.status_code == 409 and r.json()["error"]["param"] == "quantization", r.text
        assert stack.post(f"/api/v1/models/{MODEL}/unload").status_code == 200
        wait_until(lambda: stack.get(f"/api/v1/models/{MODEL}").json()["load_state"] == "unloaded", 60, "unloaded")

        # the CLI asks the same: int8 on f1
        cli = subprocess.run([sys.executable, "-m", "core.cli", "model-load", MODEL, "--wait", "--quantization", "8",
                              "--fellow-id", "f1"], env=stack.env, capture_output=True, text=True, timeout=300)
        assert cli.returncode == 0, cli.stderr
        assert "int8 weights" in cli.stdout and "stage 0 on f1" in cli.stdout, cli.stdout
        load = status(stack)
        assert load["quantization"] == {"bits": 8} and load["stages"][0]["weights"]["quantization"] == "int8"
        assert load["stages"][0]["weights"]["bytes"] <= 0.30 * load["stages"][0]["weights"]["float_bytes"]
        assert stack.post(f"/api/v1/models/{MODEL}/unload").status_code == 200
        wait_until(lambda: stack.get(f"/api/v1/models/{MODEL}").json()["load_state"] == "unloaded", 60, "unloaded")

        # NF4 through bitsandbytes: f1 probed it too (serve-quantized), f0 did not
        assert declares(stack, "f1", "serve-quantized") and not declares(stack, "f0", "serve-quantized")
        load = stack.load(MODEL, quantization={"method": "nf4"})
        assert load["quantization"] == {"method": "nf4"} and load["quantization_reason"] is None
        priced_as_served(load)
        [stage] = load["stages"]
        assert stage["fellow_id"] == "f1" and stage["weights"]["estimate_bytes"] == int(0.55 * parameters)
        assert stage["weights"]["bytes"] <= 0.17 * stage["weights"]["float_bytes"]
        assert {e["kernel"] for e in stage["kernels"]["shapes"].values()} == {"bnb-nf4"}
        r = stack.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 8,
                                                "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    finally:
        if capable is not None:
            capable.stop()
        stack.stop()


def test_a_fellow_serves_adapters_over_int8_weights_through_peft_when_asked(tmp_path, nats_server):
    """SWARM_SERVE_LORA on a fellow reaches its stage: a QLoRA-style export (adapters over a base) loaded
    at int8 keeps its adapters apart in PEFT's own layers, the status says so (with step costs on, what
    a step costs with them and without), and it chats. SWARM_SERVE_COMPILE reaches the stage too: its
    status says why these layers are not compiled."""
    from fellow.runtime.tools.export import export
    from tests.test_servable_adapters import tiny_lora

    hf, lora, _ = tiny_lora(tmp_path)
    export(hf, tmp_path / "servables" / "tuned", stages=1, adapters=lora)
    (tmp_path / "stack").mkdir()
    stack = Stack(tmp_path / "stack", nats_server.url, tmp_path / "servables", fellows=1,
                  SWARM_SERVE_LORA="peft", SWARM_SERVE_STEP_COSTS="1", SWARM_SERVE_COMPILE="1",
                  SWARM_SERVE_QUANTIZED="auto").start()
    try:
        wait_until(lambda: declares(stack, "f0", "serve-cpu-int8"), 120, "f0 declares serve-cpu-int8")
        load = stack.load("tuned", quantization={"bits": 8})
        assert load["quantization"] == {"bits": 8}, load.get("quantization_reason")
        [stage] = load["stages"]
        assert stage["weights"]["quantization"] == "int8"
        lora = stage["kernels"]["lora"]
        assert {k: lora[k] for k in ("mode", "modules")} == {"mode": "peft", "modules": 12}  # q, v, down x 4 layers
        assert set(lora["step_ms"]) == {"peft_ms", "lean_ms", "lean16_ms", "off_ms"}  # the spec's [stage0 lora-cost]
        assert stage["kernels"]["path"] == "hf"
        assert stage["kernels"]["compiled"]["asked"] == [1]
        assert stage["kernels"]["compiled"]["why"].startswith("its layers are not fused")
        # with SWARM_SERVE_COMPILE the stage keeps inductor's cache under the fellow's data dir (unless set)
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{stage['pid']}/environ").read_text().split("\0") if "=" in item)
        want = os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(Path(stack.env["SWARM_DATA_DIR"]) / "inductor"))
        assert environ.get("TORCHINDUCTOR_CACHE_DIR") == want
        r = stack.post("/v1/chat/completions", {"model": "tuned", "max_tokens": 8,
                                                "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    finally:
        stack.stop()
