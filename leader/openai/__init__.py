"""OpenAI's chat completions wire format: request schema and validation, replies, SSE chunks."""
