"""Settings are validated once, and a bad value fails fast with one line naming the cause."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.settings import Settings, SettingsError
from leader.placement import transport_plan
from tests.processes import free_port, swarm_env


@pytest.mark.parametrize("env,needle", [
    ({"SWARM_DATABASE_URL": "mysql://u@h/db"}, "SWARM_DATABASE_URL scheme 'mysql'"),
    ({"SWARM_MAX_LOADED_MODELS": "two"}, "SWARM_MAX_LOADED_MODELS='two' is not a whole number"),
    ({"SWARM_MODEL_IDLE_UNLOAD_S": "soon"}, "SWARM_MODEL_IDLE_UNLOAD_S='soon' is not a number"),
    ({"SWARM_LEADER_PORT": "99999"}, "SWARM_LEADER_PORT=99999"),
    ({"SWARM_REQUIRE_API_TOKEN": "maybe"}, "SWARM_REQUIRE_API_TOKEN='maybe' is not a boolean"),
    ({"SWARM_NATS_URL": "http://x:4222"}, "SWARM_NATS_URL entry 'http://x:4222'"),
    ({"SWARM_SERVE_PACKED_LINEAR": "fast"}, "SWARM_SERVE_PACKED_LINEAR='fast' must be one of"),
    ({"SWARM_SERVE_STEP_COSTS": "sometimes"}, "SWARM_SERVE_STEP_COSTS"),
    ({"SWARM_SERVE_SPECULATIVE": "9"}, "SWARM_SERVE_SPECULATIVE='9' must be a whole number of drafted tokens"),
    ({"SWARM_SERVE_SPECULATIVE": "-1"}, "SWARM_SERVE_SPECULATIVE='-1' must be"),
    ({"SWARM_SERVE_SPECULATIVE": "on"}, "SWARM_SERVE_SPECULATIVE='on' must be"),
    ({"SWARM_SERVE_DEVICES": "gpu0"}, "SWARM_SERVE_DEVICES='gpu0' must be auto or distinct devices"),
    ({"SWARM_SERVE_DEVICES": "cpu,cuda:0"}, "the CPU last"),
    ({"SWARM_SERVE_DEVICES": "cuda:1,cuda:1"}, "SWARM_SERVE_DEVICES='cuda:1,cuda:1'"),
    ({"SWARM_SERVE_LORA": "dora"}, "SWARM_SERVE_LORA='dora' must be one of: lean, lean16, peft"),
    ({"SWARM_SERVE_COMPILE": "fast"}, "SWARM_SERVE_COMPILE='fast' must be auto, off, on, or batch sizes from 1 to 64"),
    ({"SWARM_SERVE_COMPILE": "1,0"}, "SWARM_SERVE_COMPILE='1,0' must be auto, off, on"),
    ({"SWARM_SERVE_COMPILE": "1,99"}, "SWARM_SERVE_COMPILE='1,99' must be auto, off, on"),
    ({"SWARM_SERVE_CUDA_GRAPHS": "always"}, "SWARM_SERVE_CUDA_GRAPHS='always' must be one of: auto, off"),
    ({"SWARM_SERVE_4BIT_ROWS": "9"}, "SWARM_SERVE_4BIT_ROWS='9' must be auto, off, or a row limit from 1 to 8"),
    ({"SWARM_SERVE_4BIT_ROWS": "0"}, "SWARM_SERVE_4BIT_ROWS='0' must be auto, off, or a row limit from 1 to 8"),
    ({"SWARM_SERVE_4BIT_FLOAT32": "on"}, "SWARM_SERVE_4BIT_FLOAT32='on' must be one of: auto, off"),
])
def test_bad_values_name_the_variable(env, needle):
    with pytest.raises(SettingsError, match=needle.replace("(", r"\(").replace("?", r"\?")):
        Settings.from_env(env)


def test_nats_creds_is_one_way_to_log_in_and_a_bad_file_is_refused(tmp_path):
    """SWARM_NATS_CREDS (issue 54; a login with it: tests/test_auth_callout.py)."""
    with pytest.raises(SettingsError, match="set one, not both"):
        Settings.from_env({"SWARM_NATS_CREDS": "x.creds", "SWARM_NATS_USER": "u", "SWARM_NATS_PASSWORD": "p"})
    (tmp_path / "bad.creds").write_text("hello")
    with pytest.raises(SettingsError, match=r"^SWARM_NATS_CREDS: .*bad.creds is not a NATS .creds file"):
        Settings.from_env({"SWARM_NATS_CREDS": str(tmp_path / "bad.creds")}).nats.credentials
    assert Settings.from_env({"SWARM_NATS_CREDS": ""}).nats.credentials is None  # unset or empty is fine


def test_defaults_follow_the_spec():
    s = Settings.from_env({"SWARM_DATA_DIR": "/srv/x"})
    assert s.leader.database_url == "sqlite+aiosqlite:////srv/x/swarm.db"
    assert (s.fellow.max_loaded_models, s.fellow.model_idle_unload_s, s.serving.prefill_chunk) == (1, 900.0, None)
    assert (s.serving.typical_tokens, s.serving.context_tokens, s.serving.max_in_flight) == (1024, 4096, None)
    assert transport_plan(s, 1).max_in_flight == 8  # unset: the spec's 8, planned by the leader
    assert str(s.leader.servable_models_root) == "/srv/x/servable_models"
    assert s.serving.speculative == 0  # off until the benchmark says when it pays
    assert Settings.from_env({"SWARM_SERVE_SPECULATIVE": "4"}).serving.speculative == 4
    assert s.serving.devices == "auto"  # every GPU in order, then the CPU
    assert Settings.from_env({"SWARM_SERVE_DEVICES": "CUDA:1, cuda:0,cpu"}).serving.devices == "cuda:1,cuda:0,cpu"
    assert s.serving.lora == "lean"  # adapters over quantized weights: one addmm, no PEFT layer
    assert Settings.from_env({"SWARM_SERVE_LORA": "PEFT"}).serving.lora == "peft"
    assert s.serving.compile is None  # auto: compiled in the background once serving, no load waits for it
    assert Settings.from_env({"SWARM_SERVE_COMPILE": "on"}).serving.compile == (1,)
    assert Settings.from_env({"SWARM_SERVE_COMPILE": "8, 1,8"}).serving.compile == (1, 8)
    assert Settings.from_env({"SWARM_SERVE_COMPILE": "off"}).serving.compile == ()
    assert Settings.from_env({"SWARM_SERVE_COMPILE": "auto"}).serving.compile is None
    assert s.serving.cuda_graphs  # a whole-model CUDA stage replays its decode step where that measures faster
    assert not Settings.from_env({"SWARM_SERVE_CUDA_GRAPHS": "off"}).serving.cuda_graphs
    assert (s.serving.fourbit_rows, s.serving.fourbit_float32) == ("auto", "auto")  # 4-bit row limits measured at load
    assert Settings.from_env({"SWARM_SERVE_4BIT_ROWS": "3"}).serving.fourbit_rows == "3"


def run_cli(args, env, timeout=30):
    return subprocess.run([sys.executable, "-m", "core.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("extra,needle", [
    ({"SWARM_DATABASE_URL": "oracle://x"}, "SWARM_DATABASE_URL scheme 'oracle' is not supported"),
    ({"SWARM_HEARTBEAT_S": "fast"}, "SWARM_HEARTBEAT_S='fast' is not a number"),
])
@pytest.mark.parametrize("command", ["leader", "fellow"])
def test_cli_fails_fast_with_one_line(tmp_path, command, extra, needle):
    out = run_cli([command], swarm_env(tmp_path, "nats://127.0.0.1:1", **extra))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"swarm: error: {out.stderr.strip()[len('swarm: error: '):]}"]
    assert needle in out.stderr




@pytest.mark.parametrize("command", ["leader", "fellow", "replay"])
def test_unreachable_nats_is_one_clear_line(tmp_path, command):
    port = free_port()
    out = run_cli([command], swarm_env(tmp_path, f"nats://127.0.0.1:{port}"))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"swarm: error: cannot reach NATS at nats://127.0.0.1:{port}"), lines
