"""core/settings.py is the one reader of SWARM_* variables, and the settings table (docs/settings.md) lists
exactly the variables it knows, each with the default it applies."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.settings import NOT_IMPLEMENTED, Settings, SettingsError, variables

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `(SWARM_[A-Z0-9_]+)` \| ([^|]+) \|")
# reading a SWARM_* variable from an environment: os.environ[...], .get(...), getenv(...), .pop(...)
READ = re.compile(r"""(?:\.get|getenv|\.pop)\(\s*["']SWARM_|environ\[\s*["']SWARM_""")


def readme_table() -> dict[str, str]:
    """Variable -> its default cell, from docs/settings.md's "## Settings" section."""
    text = (ROOT / "docs" / "settings.md").read_text()
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = [ROW.match(line) for line in section.splitlines()]
    names = [m.group(1) for m in rows if m]
    assert len(names) == len(set(names)), "a variable is listed twice"
    return {m.group(1): m.group(2).strip() for m in rows if m}


def test_the_readme_table_names_every_variable_settings_knows_and_nothing_else():
    table = readme_table()
    known = {v.name for v in variables()}
    assert known.isdisjoint(NOT_IMPLEMENTED)
    assert set(table) - known - set(NOT_IMPLEMENTED) == set(), "in docs/settings.md, unknown to core/settings.py"
    missing = (known | set(NOT_IMPLEMENTED)) - set(table)
    assert missing == set(), "known to core/settings.py, missing from docs/settings.md"
    for v in variables():
        assert table[v.name] == (f"`{v.default}`" if v.default else "unset"), v.name
    for name in NOT_IMPLEMENTED:
        assert table[name] == "refused", name


class Recording(dict):
    """An environment that notes every variable asked for."""

    def __init__(self, *args):
        super().__init__(*args)
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)


def test_every_variable_is_read_and_its_default_is_the_value_it_has_unset():
    env = Recording()
    unset = Settings.from_env(env)
    assert {v.name for v in variables()} | set(NOT_IMPLEMENTED) == env.asked
    for v in variables():
        group = getattr(unset, v.group) if v.group else unset
        assert hasattr(group, v.field), v
        if v.default and "$" not in v.default:  # as docs/settings.md shows it, set by hand: the same settings
            assert Settings.from_env({v.name: v.default}) == unset, v.name
    derived = Settings.from_env({"SWARM_DATA_DIR": "/srv/x", "SWARM_LEADER_PORT": "8100"})
    assert derived.leader.url == "http://127.0.0.1:8100" and str(derived.fellow.model_cache) == "/srv/x/models"


def test_a_group_is_replaced_field_by_field_and_checked_again():
    s = Settings.from_env({})
    changed = s.replace(serving={"speculative": 4}, data_dir=Path("/srv/y"))
    assert changed.serving.speculative == 4 and changed.serving.devices == s.serving.devices
    assert changed.data_dir == Path("/srv/y") and changed.leader == s.leader
    with pytest.raises(SettingsError, match="go together"):
        s.replace(nats={"user": "fellow-f0"})


def test_a_lenient_group_reads_a_bad_value_as_its_default():
    from core.logs import log_format, stage_stats_s
    from core.settings import LoggingSettings

    assert (log_format({"SWARM_LOG_FORMAT": "JSON"}), log_format({"SWARM_LOG_FORMAT": "xml"})) == ("json", "text")
    assert (stage_stats_s({"SWARM_STAGE_STATS_S": "0.3"}), stage_stats_s({"SWARM_STAGE_STATS_S": "-1"})) == (0.3, 30)
    with pytest.raises(SettingsError, match="SWARM_LOG_FORMAT='xml' must be one of: text, json"):
        LoggingSettings.from_env({"SWARM_LOG_FORMAT": "xml"})


def test_no_module_but_core_settings_reads_a_swarm_variable():
    found = []
    for layer in ("events", "core", "leader", "fellow"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            if path == ROOT / "core" / "settings.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if READ.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "read SWARM_* through core.settings instead:\n" + "\n".join(found)
    assert READ.search('raw = (env or os.environ).get("SWARM_LOG_FORMAT")')  # the check sees what it looks for
