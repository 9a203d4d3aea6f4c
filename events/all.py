"""Import every event module so `decode_event` knows every type."""

from events import api_tokens, catalog, fellow, loads, requests  # noqa: F401
