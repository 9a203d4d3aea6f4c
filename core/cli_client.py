"""`swarm` commands that call a running leader's HTTP API (and local model tools)."""

from __future__ import annotations


def add_commands(sub) -> None:
    """Registered by later features: models, model-load, infer, model-unload, tokens, export."""
    from core import cli_tokens

    cli_tokens.add_commands(sub)
