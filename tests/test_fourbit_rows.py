"""4-bit matmuls of a few rows split into calls of a row limit, and computed in float32 where faster
(fellow.runtime.model.load.fourbit_rows; SWARM_SERVE_4BIT_ROWS, SWARM_SERVE_4BIT_FLOAT32).

On the CPU: the policy as ``QuantLinear`` applies it (calls counted, results compared), a stage built with
a fixed limit decoding as one without, the choice made from an injected timer's curves, the settings and
the capability. The measurement itself on a card runs in the ``gpu`` test only.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from core.quantization import INT4_FAST, INT8, NF4
from core.servable import load_manifest
from core.settings import Settings, SettingsError
from events.fellow import CAP_4BIT_ROWS
from events.stage import StageOptions
from fellow.runtime.model.load import fourbit_rows
from fellow.runtime.model.load.fourbit_rows import (
    FLOAT32_SAVING,
    capabilities,
    choose_row_limit,
    describe_float32,
    plan_4bit_rows,
    stage_blocks,
)
from fellow.runtime.model.load.loader import build_stage
from fellow.runtime.model.quant.linear import QuantLinear
from tests.serving_fixtures import make_servable


@pytest.fixture(scope="module")
def servable(tmp_path_factory):
    _, out = make_servable(tmp_path_factory.mktemp("fourbit"), "tiny", stages=1, layers=2, hidden=64)
    return out


def build(servable, method=INT4_FAST, dtype=None, **options):
    return build_stage(load_manifest(servable), 0, servable, 1, torch.device("cpu"),
                       StageOptions(quantization=method, **options), dtype=dtype)[1]


@pytest.fixture
def calls(monkeypatch):
    """(rows, dtype) of every kernel call of a 4-bit QuantLinear while the test runs."""
    seen = []
    kernel = QuantLinear._call

    def counted(self, x):
        if self.kernel in fourbit_rows.FOUR_BIT_KERNELS:
            seen.append((x.numel() // self.in_features, x.dtype))
        return kernel(self, x)

    monkeypatch.setattr(QuantLinear, "_call", counted)
    return seen


def weight(out_features=96, in_features=128, seed=0):
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05


def rows(n, in_features=128, seed=1, dtype=torch.float32):
    return torch.randn(n, in_features, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("method", [INT4_FAST, NF4])
def test_a_fixed_limit_splits_a_call_into_calls_of_at_most_that_many_rows_with_the_same_result(method, calls):
    lin = QuantLinear(weight(), torch.randn(96) * 0.1, method)
    x = rows(5)
    whole = lin(x)
    assert calls == [(5, torch.float32)]
    lin.row_limit = 3
    calls.clear()
    split = lin(x)
    assert [n for n, _ in calls] == [3, 2]
    if method == INT4_FAST:
        assert torch.equal(split, whole)  # each row's result is the same whatever the rows beside it
    else:
        assert torch.allclose(split, whole, atol=1e-6)  # a float32 matmul, to its rounding
    calls.clear()
    assert lin(x.view(5, 1, 128)).shape == (5, 1, 96)  # any leading shape, split by rows
    assert [n for n, _ in calls] == [3, 2]
    calls.clear()
    lin(rows(9))  # a prompt piece (more than SPLIT_MAX_ROWS rows) is never split
    lin(rows(3))
    assert [n for n, _ in calls] == [9, 3]


def test_float32_rows_cast_the_input_up_and_the_result_back(calls):
    lin = QuantLinear(weight(), None, INT4_FAST)
    lin.float32_rows = frozenset({1, 2, 0})
    for n, upcast in ((1, True), (2, True), (3, False), (12, True)):  # 0: calls past SPLIT_MAX_ROWS rows
        x = rows(n, dtype=torch.bfloat16)
        calls.clear()
        got = lin(x)
        assert calls == [(n, torch.float32 if upcast else torch.bfloat16)]
        assert got.dtype == torch.bfloat16
        want = lin._call(x.float()).to(torch.bfloat16) if upcast else lin._call(x)
        assert torch.equal(got, want)
    lin.row_limit = 1  # split first, then each part by its own count
    calls.clear()
    lin(rows(3, dtype=torch.bfloat16))
    assert calls == [(1, torch.float32)] * 3
    calls.clear()
    lin(rows(3))  # a float32 input stays as it is
    assert calls == [(1, torch.float32)] * 3


def test_a_stage_with_a_fixed_limit_decodes_a_batch_as_without(servable, calls):
    plain, split = build(servable), build(servable, fourbit_rows=3)
    assert split.kernels.fourbit_rows["row_limit"] == 3 and plain.kernels.fourbit_rows["row_limit"] == 0
    assert {lin.row_limit for block in stage_blocks(split) for lin in block} == {3}
    assert split.head.linear.row_limit == 0  # the int8 head is left as it is
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 380, (int(n),), generator=g).tolist() for n in (5, 9, 7, 12, 6)]
    outs = {}
    for name, stage in (("plain", plain), ("split", split)):
        caches = [stage.new_cache() for _ in prompts]
        logits = torch.stack([stage.prefill(cache, torch.tensor(p)) for cache, p in zip(caches, prompts)])
        tokens, steps = [logits.argmax(-1).tolist()], [logits]
        calls.clear()
        for _ in range(12):
            logits = stage.decode(caches, torch.tensor(tokens[-1]))
            tokens.append(logits.argmax(-1).tolist())
            steps.append(logits)
        decode_rows = {n for n, _ in calls}
        outs[name] = tokens, torch.stack(steps), decode_rows
    assert outs["split"][0] == outs["plain"][0]
    assert torch.equal(outs["split"][1], outs["plain"][1])  # int4 rows are exact alone: the same logits
    assert outs["plain"][2] == {5} and outs["split"][2] == {3, 2}  # five sessions a step: 3 + 2 rows



JUMP = {1: 1.0, 2: 1.05, 3: 1.1, 4: 4.5, 5: 4.6, 6: 4.7, 7: 4.8, 8: 4.9, 256: 40.0}  # the GTX 1660 SUPER's shape
LINEAR = {m: 0.5 + 0.1 * m for m in JUMP}  # a card that grows smoothly with rows: no split


def timer(half: dict[int, float], faster_from: int | None = None, saving: float = 0.0):
    """A time_block whose stage-dtype curve is ``half``; float32 saves ``saving`` from ``faster_from`` rows
    (and at the prompt piece) and costs 20 % more below."""
    def time_block(linears, m, float32):
        assert linears and all(lin.kernel == "int4" for lin in linears)
        if not float32:
            return half[m]
        return half[m] * (1 - saving if faster_from is not None and m >= faster_from else 1.2)
    return time_block


@pytest.fixture(scope="module")
def half_stage(servable):
    """A stage that does not compute in float32: float32 is measured too."""
    stage = build(servable, dtype=torch.bfloat16)
    assert stage.dtype == torch.bfloat16
    return stage


@pytest.mark.parametrize("half,faster_from,saving,limit,upcast,verdict", [
    (JUMP, 4, 0.20, 3, {4, 5, 6, 7, 8, 0}, "calls of more rows split into 3; float32 from 4 rows up"),
    (JUMP, 4, 0.10, 3, set(), "calls of more rows split into 3; float32 nowhere"),
    (JUMP, None, 0.0, 3, set(), "calls of more rows split into 3; float32 nowhere"),
    (LINEAR, 1, 0.20, 0, {1, 2, 3, 4, 5, 6, 7, 8, 0}, "no split; float32 from 1 row up"),
    (LINEAR, None, 0.0, 0, set(), "no split; float32 nowhere"),
    # float32 takes the jump away: over the faster way at each count, 8 rows are cheapest per row
    ({**JUMP, **{m: t * 1.3 for m, t in JUMP.items() if m >= 4}}, 4, 0.75, 0, {4, 5, 6, 7, 8, 0},
     "no split; float32 from 4 rows up"),
])
def test_the_choice_from_the_measured_curves_and_the_log_line(half_stage, caplog, half, faster_from, saving, limit,
                                                              upcast, verdict):
    with caplog.at_level(logging.INFO, logger="fellow.runtime.model.load.fourbit_rows"):
        status = plan_4bit_rows(half_stage, measure_cpu=True, prefill_chunk=256, label="stage0",
                                time_block=timer(half, faster_from, saving))
    assert status["row_limit"] == limit
    assert set(status["float32_rows"]) | ({0} if status["float32_prompt_pieces"] else set()) == upcast
    assert set(status["ms"]) == set(status["float32_ms"]) == {"1", "2", "3", "4", "5", "6", "7", "8", "256"}
    assert json.loads(json.dumps(status)) == status  # it travels in the ready report
    linears = [lin for block in stage_blocks(half_stage) for lin in block]
    assert len(linears) == status["linears"] == 8  # qkv, o, gate_up, down of both layers
    assert {(lin.row_limit, lin.float32_rows) for lin in linears} == {(limit, frozenset(upcast))}
    line = [r.getMessage() for r in caplog.records if "4bit-rows" in r.getMessage()][-1]
    assert line.startswith("[stage0 4bit-rows] cpu one block ms M=1:")
    assert " M=8:" in line and "; float32 M=1:" in line and " M=256:" in line
    assert line.endswith(verdict), line


def test_the_row_limit_rule():
    assert choose_row_limit(JUMP) == 3
    assert choose_row_limit(LINEAR) == 0  # 8 rows the cheapest per row: nothing split
    assert choose_row_limit({m: 1.0 for m in range(1, 9)}) == 0  # flat: the largest count
    assert choose_row_limit({**{m: 1.0 * m for m in range(1, 9)}, 2: 1.97}) == 0  # within ROW_TIE of the least
    assert FLOAT32_SAVING == 0.15
    assert describe_float32(frozenset({1, 2})) == "float32 at M=1,2"
    assert describe_float32(frozenset({5, 6, 7, 8})) == "float32 at M=5,6,7,8"
    assert describe_float32(frozenset({0})) == "float32 for prompt pieces only"


def test_a_cpu_stage_is_not_measured_by_default_and_off_or_int8_does_nothing(servable, caplog):
    with caplog.at_level(logging.INFO, logger="fellow.runtime.model.load.fourbit_rows"):
        stage = build(servable, NF4)
    status = stage.kernels.fourbit_rows
    assert status["row_limit"] == 0 and status["float32_rows"] == [] and "ms" not in status
    assert status["why"].startswith("measured on CUDA only")
    assert "[stage0 4bit-rows] cpu not measured (CUDA only); no split" in caplog.text
    assert build(servable, fourbit_rows="off", fourbit_float32="off").kernels.fourbit_rows is None
    assert build(servable, INT8).kernels.fourbit_rows is None  # no 4-bit weight
    fixed = build(servable, fourbit_rows=8).kernels.fourbit_rows  # a limit of 8 splits nothing
    assert fixed["row_limit"] == 0
    with pytest.raises(ValueError, match="auto, off, or 1 to 8"):
        build(servable, fourbit_rows=9)


def test_the_settings_parse_and_refuse_with_one_line():
    s = Settings.from_env({})
    assert (s.serving.fourbit_rows, s.serving.fourbit_float32) == ("auto", "auto")
    assert Settings.from_env({"SWARM_SERVE_4BIT_ROWS": " OFF "}).serving.fourbit_rows == "off"
    assert Settings.from_env({"SWARM_SERVE_4BIT_ROWS": "3"}).serving.fourbit_rows == "3"
    assert Settings.from_env({"SWARM_SERVE_4BIT_FLOAT32": "off"}).serving.fourbit_float32 == "off"
    for bad in ("0", "9", "x", "-1", "2.5"):
        with pytest.raises(SettingsError) as err:
            Settings.from_env({"SWARM_SERVE_4BIT_ROWS": bad})
        assert str(err.value) == f"SWARM_SERVE_4BIT_ROWS={bad!r} must be auto, off, or a row limit from 1 to 8"
    with pytest.raises(SettingsError, match="SWARM_SERVE_4BIT_FLOAT32='on' must be one of: auto, off"):
        Settings.from_env({"SWARM_SERVE_4BIT_FLOAT32": "on"})


def test_the_fellow_declares_serve_4bit_rows_on_cuda_unless_off(capsys):
    assert CAP_4BIT_ROWS == "serve-4bit-rows"
    assert capabilities(has_cuda=True, rows="auto") == [CAP_4BIT_ROWS]
    assert capabilities(has_cuda=True, rows="3") == [CAP_4BIT_ROWS]
    assert capabilities(has_cuda=True, rows="off") == []
    assert capabilities(has_cuda=False, rows="auto") == []
    from fellow.runtime.probe import main

    assert main(["--4bit-rows", "auto"]) == 0
    found = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (CAP_4BIT_ROWS in found) == torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("method", [NF4, INT4_FAST])
def test_on_cuda_a_4bit_stage_measures_its_rows_and_decodes_as_with_whole_calls(servable, method):
    from fellow.runtime.model.quant.linear import Int4Unavailable, tinygemm_check_device

    if method == INT4_FAST:
        try:
            tinygemm_check_device(torch.device("cuda:0"))
        except Int4Unavailable as exc:
            pytest.skip(str(exc))
    stage = build_stage(load_manifest(servable), 0, servable, 1, torch.device("cuda:0"),
                        StageOptions(quantization=method, cuda_graphs=False))[1]
    status = stage.kernels.fourbit_rows
    assert status["device"] == "cuda:0" and set(status["ms"]) >= {str(m) for m in range(1, 9)}, status
    if stage.dtype != torch.float32:
        assert "256" in status["float32_ms"], status
    assert 0 <= status["row_limit"] < 8
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 380, (int(n),), generator=g).tolist() for n in (5, 9, 7, 12, 6)]
    linears = [lin for block in stage_blocks(stage) for lin in block]
    policy = {(lin.row_limit, lin.float32_rows) for lin in linears}

    def steps(row_limit, float32_rows):
        """Five sessions' decode logits, fed the same tokens, under a row policy."""
        for lin in linears:
            lin.row_limit, lin.float32_rows = row_limit, float32_rows
        caches = [stage.new_cache() for _ in prompts]
        for cache, p in zip(caches, prompts):
            stage.prefill(cache, torch.tensor(p, device="cuda:0"))
        return torch.stack([stage.decode(caches, torch.tensor([3 + i] * 5, device="cuda:0")).float()
                            for i in range(6)])

    (limit, upcast), = policy
    measured = steps(limit, upcast)
    whole = steps(0, frozenset())
    assert torch.isfinite(measured).all()
    # each row the same computation either way, to the rounding of a half-precision kernel at another row count
    assert float((measured - whole).abs().max()) <= 0.05 * float(whole.abs().max()) + 1e-2


def test_a_float32_call_that_fails_leaves_the_stage_in_its_dtype(half_stage, caplog):
    def time_block(linears, m, float32):
        if float32:
            raise RuntimeError("no float32 rows for this kernel")
        return JUMP[m]

    with caplog.at_level(logging.INFO, logger="fellow.runtime.model.load.fourbit_rows"):
        status = plan_4bit_rows(half_stage, measure_cpu=True, time_block=time_block)
    assert status["row_limit"] == 3 and status["float32_rows"] == [] and "float32_ms" not in status
    assert status["why"].startswith("float32 failed on this card (RuntimeError: no float32 rows")
    assert caplog.text.rstrip().endswith("calls of more rows split into 3; float32 nowhere")
