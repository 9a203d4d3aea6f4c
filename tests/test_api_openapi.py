"""The OpenAPI schema of the real app describes the typed bodies of chat, load and token creation."""

from __future__ import annotations

from tests.tokens_app import leader_client

ROUTES = {  # path, method: properties the request body must list, the response schema's
    ("/v1/chat/completions", "post"): ({"model", "messages", "max_tokens", "seed", "chat_template_kwargs"},
                                       {"id", "object", "choices", "usage"}),
    ("/api/v1/models/{model_id}/load", "post"): ({"num_stages", "fellow_id", "replicas", "wait", "timeout_s"},
                                                 {"load_id", "state", "stages", "replicas"}),
    ("/api/v1/api-tokens", "post"): ({"label", "scopes", "expires_in"}, {"id", "scopes", "prefix", "token"}),
}


def resolve(spec: dict, schema: dict) -> dict:
    """A schema with its $ref followed (one level: the named component)."""
    ref = schema.get("$ref")
    if ref is None:
        return schema
    assert ref.startswith("#/components/schemas/"), ref
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]]


async def test_chat_load_and_token_routes_have_typed_bodies(tmp_path, nats_server, sqlite_url):
    async with leader_client(tmp_path, nats_server.url, sqlite_url) as (app, c):
        r = await c.get("/schema/openapi.json")
    assert r.status_code == 200, r.text
    spec = r.json()
    for (path, method), (request_props, response_props) in ROUTES.items():
        op = spec["paths"][path][method]
        body = resolve(spec, op["requestBody"]["content"]["application/json"]["schema"])
        assert request_props <= set(body["properties"]), (path, sorted(body["properties"]))
        ok = next(v for k, v in op["responses"].items() if k.startswith("2"))
        reply = resolve(spec, ok["content"]["application/json"]["schema"])
        assert response_props <= set(reply["properties"]), (path, sorted(reply.get("properties", {})))
