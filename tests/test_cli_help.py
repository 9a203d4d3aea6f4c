"""The CLI explains itself (issue 38): every option and argument has a help text, the top help names the
variables the client commands read, and `model-load --wait` says what a stage's weights are in words."""

from __future__ import annotations

import argparse
import subprocess
import sys

from core.cli import build_parser
from core.cli_models import _weights


def _parsers(p: argparse.ArgumentParser, name: str = "swarm"):
    yield name, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_option_and_argument_has_help():
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in _parsers(build_parser())
               for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert missing == []


def test_the_help_names_the_client_variables():
    out = subprocess.run([sys.executable, "-m", "core.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "SWARM_LEADER_URL" in out.stdout and "SWARM_API_TOKEN" in out.stdout


def test_a_stages_weights_read_as_words():
    assert _weights({"weights": {"quantization": "none", "bytes": 11_000_000, "estimate_bytes": 9_000_000}}) \
        == ", weights 11MB measured (9MB estimated)"
    assert _weights({"weights": {"quantization": "int8", "bytes": 5_300_000, "estimate_bytes": 5_200_000}}) \
        == ", int8 weights 5MB measured (5MB estimated)"
    assert _weights({}) == ""


def test_token_labels_print_without_controls():
    """A label minted before the leader refused controls is shown escaped, not obeyed by the terminal."""
    from core.cli_tokens import printable

    assert printable("ops\x00\u202etxt\x1b[2J 👨\u200d👩") == "ops\\u0000\\u202etxt\\u001b[2J 👨\u200d👩"
