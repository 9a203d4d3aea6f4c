"""The spec's configuration table (its "Environment variables", kept beside the repository) and
core/settings.py agree: every variable it names is read, and unset means what the spec says it means."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.settings import Settings, variables
from events.commands import LoadStage
from events.loads import StageAssignment
from fellow.manager import stage_options
from leader.placement import OLD_FELLOW_IN_FLIGHT, transport_plan

ROOT = Path(__file__).resolve().parents[1]
SPEC_DIRS = [ROOT.parent / "shared" / "seed", ROOT / "shared" / "seed"]  # beside the checkout, or in it


def spec_table() -> dict[str, str]:
    """Variable -> its default cell, from the spec's tab-separated "Environment variables" table."""
    for folder in SPEC_DIRS:
        for page in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
            text = page.read_text(errors="replace")
            if "\nEnvironment variables\n" in text:
                rows = text.split("\nEnvironment variables\n", 1)[1].split("\n")
                cells = [row.split("\t") for row in rows if row.startswith("SWARM_")]
                return {c[0].strip(): c[1].strip() for c in cells if len(c) >= 3}
    pytest.skip("the spec is not beside this checkout")


def _one(**env) -> Settings:
    return Settings.from_env(env)


def _load(num_stages: int, **plan) -> LoadStage:
    return LoadStage(load_id="ld", model_id="m", num_stages=num_stages,
                     assignment=StageAssignment(stage=0, fellow_id="f"),
                     transport=transport_plan(_one(**plan), num_stages))


UNSET = _one()
# the defaults the spec writes as a rule rather than a value, each checked where that rule is applied
RULES = {
    "SWARM_SERVABLE_MODELS_ROOT": lambda: _one(SWARM_DATA_DIR="/srv/x").leader.servable_models_root
    == Path("/srv/x/servable_models"),
    "SWARM_FELLOW_MODEL_CACHE": lambda: UNSET.fellow.model_cache == Path("~/.silent-swarm/models").expanduser(),
    # 4 x stages, 2 x stages with a fellow before serve-kv-budget (tests/test_old_fellows.py)
    "SWARM_SERVE_IN_FLIGHT": lambda: [transport_plan(UNSET, n).max_in_flight for n in (2, 3, 4)] == [8, 12, 16]
    and OLD_FELLOW_IN_FLIGHT == 2,
    # a fellow's 0 (no cap) where neither sets it; the leader's unset (its pre-Ampere cap: test_batch_cap.py)
    "SWARM_SERVE_MAX_BATCH": lambda: stage_options(UNSET, _load(1)).max_batch == 0 and UNSET.serving.max_batch is None,
    "SWARM_SERVE_MAX_BATCH (leader)": lambda: transport_plan(UNSET, 2).max_batch == 0,
    "SWARM_SERVE_PREFILL_CHUNK": lambda: stage_options(UNSET, _load(1)).prefill_chunk
    == stage_options(UNSET, _load(2)).prefill_chunk == 256,
    "SWARM_SERVE_MAX_IN_FLIGHT": lambda: stage_options(UNSET, _load(1)).max_in_flight == 8,
    "SWARM_API_TOKENS_FILE": lambda: _one(SWARM_DATA_DIR="/srv/x").leader.tokens_file == Path("/srv/x/api_tokens.json")
    and _one(SWARM_DATABASE_URL="sqlite+aiosqlite:////var/db/s.db").leader.tokens_file == Path("/var/db")
    / "api_tokens.json",
}


def _value(settings: Settings, name: str):
    v = next(v for v in variables() if v.name == name)
    return getattr(getattr(settings, v.group) if v.group else settings, v.field)


def test_every_variable_of_the_spec_is_read_with_the_default_it_names():
    table = spec_table()
    known = {v.name for v in variables()}
    assert {name.split(" ")[0] for name in table} <= known, "in the spec, unknown to core/settings.py"
    for name, default in table.items():
        if name in RULES:
            assert RULES[name](), f"{name}: not what the spec's default {default!r} says"
        elif default == "unset":
            assert not _value(UNSET, name), name  # None, "" or off
        else:  # a value: set by hand, the same settings as unset
            assert _one(**{name: default}) == UNSET, f"{name}: the spec's default {default!r} is not ours"
    assert set(RULES) <= set(table), "a rule for a row the spec does not have"


def test_the_tokens_file_is_beside_a_sqlite_database_and_off_or_none_elsewhere():
    assert _one(SWARM_API_TOKENS_FILE="off").leader.tokens_file is None
    assert _one(SWARM_API_TOKENS_FILE="/etc/swarm/tokens.json").leader.tokens_file == Path("/etc/swarm/tokens.json")
    assert _one(SWARM_DATABASE_URL="postgresql+asyncpg://db/swarm").leader.tokens_file is None
    assert _one(SWARM_DATABASE_URL="sqlite+aiosqlite:///:memory:").leader.tokens_file is None
