"""The AVX2 int8 kernel a quantized stage's decode steps multiply with (fellow.runtime.model.quant.int8_gemv):
it computes what its torch reference does (rows quantized in blocks of 32, integer products) over every
row count it takes, within 1 % of the float product; an int8 QuantLinear calls it for a decode step's rows
and torch's kernel for a prompt's; and where it cannot build the stage says why and multiplies with
torch's kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fellow.runtime.model.quant import int8_gemv
from fellow.runtime.model.quant.linear import QuantLinear

ROOT = Path(__file__).resolve().parents[1]

needs_kernel = pytest.mark.skipif(not int8_gemv.available(), reason=f"no int8 kernel: {int8_gemv.unavailable_reason()}")


@needs_kernel
@pytest.mark.parametrize("n,k", [(1000, 96), (7, 32), (16, 64), (300, 512), (5, 3072)])
def test_it_computes_its_reference_and_stays_near_the_float_product(n, k):
    generator = torch.Generator().manual_seed(n * k)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    scales = torch.rand(n, generator=generator)
    for rows in range(1, int8_gemv.MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=generator)
        if k > int8_gemv.BLOCK:
            x[0, :32] = 0.0  # a block of zeros: scale 0, no division by it
        got = int8_gemv.int8_gemv(x, weight, scales)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        torch.testing.assert_close(got.double(), int8_gemv.reference(x, weight, scales), rtol=1e-5, atol=1e-3)
        exact = x.double() @ weight.double().t() * scales.double()
        assert float((got.double() - exact).norm() / exact.norm()) < 0.01


@needs_kernel
def test_a_quantized_linear_takes_it_for_a_few_rows_and_torchs_for_more():
    weight = torch.randn(96, 160)
    linear = QuantLinear(weight, torch.randn(96), "int8")
    few, many = torch.randn(1, 3, 160), torch.randn(40, 160)
    expected = int8_gemv.reference(few[0], linear.weight, linear.scales_f32) + linear.bias.double()
    torch.testing.assert_close(linear(few)[0].double(), expected, rtol=1e-5, atol=1e-4)
    # more rows: torch's kernel, which reads them in bfloat16 and writes bfloat16
    dequantized = linear.weight.double() * linear.scales_f32.double()[:, None]
    reference = many.to(torch.bfloat16).double() @ dequantized.t() + linear.bias.double()
    torch.testing.assert_close(linear(many).double(), reference, rtol=2e-2, atol=2e-2)
    # inputs not in blocks of 32: torch's kernel at any row count
    odd = QuantLinear(torch.randn(16, 80), None, "int8")
    rows = torch.randn(2, 80)
    odd_reference = rows.to(torch.bfloat16).double() @ (odd.weight.double() * odd.scales_f32.double()[:, None]).t()
    torch.testing.assert_close(odd(rows).double(), odd_reference, rtol=2e-2, atol=2e-2)


def test_without_a_compiler_each_kernel_says_why_and_torchs_kernel_multiplies(tmp_path):
    code = """
import json, torch
from fellow.runtime.model.quant import int8_gemv
from fellow.runtime.model.quant.linear import QuantLinear
linear = QuantLinear(torch.randn(32, 64), None, "int8")
x = torch.randn(2, 64)
ref = (x.to(torch.bfloat16).double() @ (linear.weight.double() * linear.scales_f32.double()[:, None]).t())
from fellow.runtime.kernels import attend_kernel, f32_gemv
from fellow.runtime.model.forms.graph_linear import gemv_forms
print(json.dumps({"available": int8_gemv.available(), "why": int8_gemv.unavailable_reason(),
                  "kernel": int8_gemv.rows_kernel(), "diff": float((linear(x).double() - ref).abs().max()),
                  "others": [attend_kernel.unavailable_reason(), f32_gemv.unavailable_reason()],
                  "forms": list(gemv_forms())}))
"""
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert not found["available"] and found["kernel"].startswith("aten (") and found["why"], found
    assert found["diff"] < 0.1, found  # torch's bfloat16 kernel served the call
    # the project's other kernels say why too, and the compile builds no form that needs one
    assert all(found["others"]), found
    assert found["forms"] == ["reduce", "linear"], found
