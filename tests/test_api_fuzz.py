"""schemathesis over the real app's OpenAPI schema (issue 18): bounded examples per operation, served by
uvicorn on a real nats-server and SQLite. No response is a 5xx; every error is its API's error object:
Anthropic's on /v1/messages, Ollama's on its /api/ routes, OpenAI's on the rest."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from leader.app import create_app
from tests.chat_fixtures import served
from tests.conftest import make_settings

pytestmark = pytest.mark.slow
EXAMPLES = 8  # per operation


def check_operation(op, url: str, seen: list) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy())
    def one(case):
        response = case.call(base_url=url, timeout=30)
        where = f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
        seen.append(response.status_code)
        assert response.status_code < 500, where
        if response.status_code >= 400 and case.path.startswith("/v1/messages"):
            body = response.json()
            assert body.get("type") == "error" and set(body["error"]) == {"type", "message"}, where
        elif response.status_code >= 400 and case.path.startswith("/api/") and not case.path.startswith("/api/v1/"):
            assert list(response.json()) == ["error"] and isinstance(response.json()["error"], str), where
        elif response.status_code >= 400:
            error = response.json().get("error")
            assert isinstance(error, dict) and isinstance(error.get("message"), str) and error.get("type"), where
            assert {"message", "type", "param", "code"} <= set(error), where

    one()


async def test_no_input_the_schema_allows_gets_a_server_error(tmp_path, nats_server, sqlite_url):
    app = create_app(make_settings(tmp_path, nats_server.url, sqlite_url))
    async with served(app) as url:
        async with httpx.AsyncClient() as http:
            spec = (await http.get(url + "/schema/openapi.json")).json()
        schema = schemathesis.openapi.from_dict(spec)
        seen: list[int] = []
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) > 10
        for op in operations:
            await asyncio.to_thread(check_operation, op, url, seen)
    assert len(seen) >= len(operations) and any(code >= 400 for code in seen)
