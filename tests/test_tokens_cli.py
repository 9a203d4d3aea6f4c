"""`swarm tokens` as a real subprocess against a real leader process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import SwarmProcess, free_port, swarm_env

SWARM = str(Path(sys.executable).parent / "swarm")  # the installed entry point users run


def swarm(env: dict, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if k != "SWARM_API_TOKEN"}
    if token:
        env["SWARM_API_TOKEN"] = token
    return subprocess.run([SWARM, *args], env=env, capture_output=True, text=True, timeout=60)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("swarm: error: "), result.stderr
    return lines[0]


@pytest.fixture
def leader(tmp_path, nats_server):
    env = swarm_env(tmp_path, nats_server.url, f"sqlite+aiosqlite:///{tmp_path / 'swarm.db'}")
    proc = SwarmProcess(["leader"], env, tmp_path / "leader.log").start()
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def test_tokens_create_list_revoke(leader):
    env = {**leader.env, "SWARM_LEADER_URL": leader.base_url}
    made = swarm(env, "tokens", "create", "--label", "laptop", "--scope", "operate")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert re.fullmatch(r"sk-swarm-[0-9A-Za-z]{49}", secret), made.stdout
    assert "operate, admin" in made.stderr and "not shown again" in made.stderr  # first token: admin

    assert "401" in one_line_error(swarm(env, "tokens", "list"))  # enforcement is on now
    ci = swarm(env, "tokens", "create", "--label", "ci", "--scope", "read", "--scope", "operate",
               "--expires-in", "3600", token=secret)
    assert ci.returncode == 0, ci.stderr
    ci_secret = ci.stdout.strip()
    assert ci_secret != secret

    listed = swarm(env, "tokens", "list", token=secret)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[1]: line.split() for line in listed.stdout.splitlines()[1:]}
    assert set(rows) == {"laptop", "ci"}
    assert rows["ci"][2] == "read,operate" and rows["ci"][-1] == "active"
    assert secret not in listed.stdout and ci_secret not in listed.stdout
    assert rows["laptop"][3] == secret[:13]  # the display prefix

    assert "403" in one_line_error(swarm(env, "tokens", "list", token=ci_secret))  # operate is not admin
    ci_id = rows["ci"][0]
    revoked = swarm(env, "tokens", "revoke", ci_id, token=secret)
    assert revoked.returncode == 0 and ci_id in revoked.stdout, revoked.stderr
    assert "revoked" in one_line_error(swarm(env, "tokens", "list", token=ci_secret))
    again = swarm(env, "tokens", "list", token=secret)
    assert {line.split()[1]: line.split()[-1] for line in again.stdout.splitlines()[1:]}["ci"] == "revoked"

    assert "404" in one_line_error(swarm(env, "tokens", "revoke", "tok_nope", token=secret))
    assert "scopes" in one_line_error(swarm(env, "tokens", "create", "--label", "x", "--scope", "root", token=secret))

    # The last live token: the CLI refuses without --force; with it, the answer says the API is open.
    laptop_id = rows["laptop"][0]
    refused = one_line_error(swarm(env, "tokens", "revoke", laptop_id, token=secret))
    assert "last live token" in refused and "--force" in refused
    assert swarm(env, "tokens", "list", token=secret).returncode == 0  # still in force
    forced = swarm(env, "tokens", "revoke", laptop_id, "--force", token=secret)
    assert forced.returncode == 0 and laptop_id in forced.stdout, forced.stderr
    assert "open to anyone" in forced.stderr
    assert swarm(env, "tokens", "list").returncode == 0  # open: no token needed


def test_tokens_cli_without_a_leader(tmp_path):
    env = swarm_env(tmp_path, None, SWARM_LEADER_URL=f"http://127.0.0.1:{free_port()}")
    assert "cannot reach the leader" in one_line_error(swarm(env, "tokens", "list"))
