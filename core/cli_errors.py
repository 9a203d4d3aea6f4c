"""The CLI's one error type, apart from core.cli so that every command module and leader.replay_cli can
raise it without importing the entry point."""


class CliError(Exception):
    """A one-line reason printed as `swarm: error: ...` with exit code 2."""
