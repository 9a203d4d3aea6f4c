"""The README's snippets run, as written, against a real stack serving a tiny model as `swarm-demo`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serving_fixtures import Stack, make_servable

README = Path(__file__).resolve().parents[1] / "README.md"
DEFAULT_URL = "http://127.0.0.1:8000"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def shell_commands() -> list[str]:
    """Every command of the sh blocks but the first block (the two make targets, which CI runs)."""
    commands = []
    for block in blocks("sh")[1:]:
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    return commands


def test_readme_opens_with_the_two_commands():
    first = blocks("sh")[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make run", "make test"]
    assert README.read_text().lstrip().startswith("# Swarm\n\n```sh\nmake run")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from core.nats_server import EmbeddedNats

    root = tmp_path_factory.mktemp("readme")
    make_servable(root, "swarm-demo", layers=2, hidden=64, stages=2)
    nats = EmbeddedNats(root / "js").start()
    stack = Stack(root, nats.url, root / "servables", SWARM_AUTOLOAD=1).start()
    yield stack
    stack.stop()
    nats.stop()


def test_readme_snippets_run(stack):
    env = dict(stack.env, SWARM_LEADER_URL=stack.url, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    commands = shell_commands()
    assert any(c.startswith("curl") and "chat/completions" in c for c in commands)
    assert any(c.startswith("swarm infer") for c in commands)
    python = blocks("python")
    assert python, "the README shows the OpenAI SDK"
    order = commands[:1] + ["<python>"] + commands[1:]
    for command in order:
        if command == "<python>":
            code = python[0].replace(DEFAULT_URL, stack.url)
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        else:
            out = subprocess.run(command.replace(DEFAULT_URL, stack.url), shell=True, env=env,
                                 capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (command, out.stdout, out.stderr, stack.logs())
        assert out.stdout.strip(), (command, out.stderr)
        if command.startswith("curl") and "chat/completions" in command:
            assert '"chat.completion"' in out.stdout.replace(" ", ""), out.stdout
        if command.startswith("swarm tokens create"):
            assert out.stdout.startswith("sk-swarm-")
