"""The pages a newcomer reads stay short enough to read (issue 52): README at most 150 lines,
docs/benchmarks.md at most 400 (history lives in git), docs/architecture.md at most 350 with its
decode-step table."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("page,most", [("README.md", 150), ("docs/benchmarks.md", 400),
                                       ("docs/architecture.md", 350)])
def test_a_page_stays_within_its_length(page, most):
    lines = (ROOT / page).read_text().count("\n")
    assert lines <= most, f"{page} is {lines} lines, over {most}: move detail to its own page"


def test_the_architecture_page_has_the_decode_step_table():
    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("## The decode step", 1)[1].split("\n## ", 1)[0]
    assert "| form (`name`) | file | when it serves | who plans it |" in section
    for form in ("compiled", "native", "cuda_graphs", "fused", "hf_alone", "recurrent_batched"):
        assert form in section, form
