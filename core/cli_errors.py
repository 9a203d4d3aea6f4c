"""The CLI's one error type, apart from core.cli so that every command module and leader.replay_cli can
raise it without importing the entry point; and ``part``, how the CLI reaches the leader's and the
fellow's code."""


class CliError(Exception):
    """A one-line reason printed as `swarm: error: ...` with exit code 2."""


def part(name: str):
    """What the leader or the fellow registers under ``name`` for the CLI (pyproject.toml's
    ``swarm.parts`` entry points): core/ finds it by name instead of importing leader/ or fellow/."""
    from importlib.metadata import entry_points

    found = entry_points(group="swarm.parts", name=name)
    if not found:
        raise CliError(f"this install has no '{name}': reinstall the project (pip install -e '.[fellow]')")
    return next(iter(found)).load()
