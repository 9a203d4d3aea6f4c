"""`swarm` commands that call a running leader's HTTP API (and local model tools)."""

from __future__ import annotations


def add_commands(sub) -> None:
    """Registered by later features: models, model-load, infer, model-unload, tokens, export."""
    from core import cli_models, cli_tokens

    cli_models.add_commands(sub)
    cli_tokens.add_commands(sub)
