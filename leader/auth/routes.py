"""POST/GET/DELETE /api/v1/api-tokens: mint (secret shown once), list, revoke; admin scope."""

from __future__ import annotations

import msgspec
from litestar import delete, get, post
from litestar.params import FromPath, JSONBody

from events.api_tokens import unprintable
from leader.api.body import StructBody
from leader.api.deps import AuthDep, Caller
from leader.auth.scopes import SCOPES, canonical
from leader.errors import ApiError

MAX_LABEL_CHARS = 255
MAX_EXPIRES_IN_S = 100 * 365 * 24 * 3600.0
ADMIN = {"scope": "admin"}


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, code="invalid_request", param=param)


class MintBody(msgspec.Struct, kw_only=True):
    label: str  # names the token; at most 255 characters
    scopes: list[str]  # read, operate, admin
    expires_in: float | None = None  # seconds; none: the token never expires


class ApiTokenView(msgspec.Struct, kw_only=True):
    object: str = "api_token"
    id: str
    label: str
    scopes: list[str]
    prefix: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None


class ApiTokenCreated(ApiTokenView, kw_only=True):
    token: str  # the secret, shown in this answer only


class ApiTokenRevokedView(ApiTokenView, kw_only=True):
    api_open: bool  # true: no live token is left, so the API is open to anyone again (first-run mode)
    message: str | None = None  # says so when it is


class ApiTokenList(msgspec.Struct):
    data: list[ApiTokenView]
    object: str = "list"


def parse_mint(body: bytes) -> MintBody:
    """The mint body, or a 400 naming the offending parameter."""
    try:
        data = msgspec.json.decode(body) if body.strip() else None
    except msgspec.DecodeError:
        raise _bad("The request body is not valid JSON.", None) from None
    except RecursionError:
        raise _bad("The request body nests too deeply.", None) from None
    if not isinstance(data, dict):
        raise _bad('The request body must be a JSON object: {"label", "scopes", "expires_in"?}.', None)
    label = data.get("label")
    if not isinstance(label, str) or not label.strip():
        raise _bad("'label' is required: a non-empty string naming the token.", "label")
    if len(label) > MAX_LABEL_CHARS:
        raise _bad(f"'label' is longer than {MAX_LABEL_CHARS} characters.", "label")
    if bad := next(filter(unprintable, label), None):
        # a terminal would obey it: NUL, escapes, U+202E turning `swarm tokens list` around
        raise _bad(f"'label' holds the control or formatting character U+{ord(bad):04X}: use printable text.",
                   "label")
    scopes = data.get("scopes")
    if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) for s in scopes):
        raise _bad(f"'scopes' is required: a non-empty list drawn from {', '.join(SCOPES)}.", "scopes")
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise _bad(f"'scopes' holds unknown scope(s) {', '.join(unknown)}; known: {', '.join(SCOPES)}.", "scopes")
    expires_in = data.get("expires_in")
    if expires_in is not None:  # compared before any float(): an int of 400 digits does not fit one
        if isinstance(expires_in, bool) or not isinstance(expires_in, (int, float)) \
                or not 0 < expires_in <= MAX_EXPIRES_IN_S:
            raise _bad(f"'expires_in' must be a number of seconds above 0 and at most {MAX_EXPIRES_IN_S:.0f}.",
                       "expires_in")
        expires_in = float(expires_in)
    return MintBody(label=label.strip(), scopes=canonical(scopes), expires_in=expires_in)


class MintBodyDTO(StructBody[MintBody]):
    decode = staticmethod(parse_mint)


@post("/api/v1/api-tokens", tags=["api-tokens"], status_code=201, opt={**ADMIN, "first_run_open": True},
      dto=MintBodyDTO, return_dto=None, summary="Mint an API token; the secret is in this response only")
async def create_api_token(auth: AuthDep, caller: Caller,
                           data: JSONBody[MintBody | None] = None) -> ApiTokenCreated:
    if data is None:
        data = parse_mint(b"")  # refuses the missing body with the same 400 as a bad one
    record, secret = await auth.mint(data.label, data.scopes, data.expires_in, caller)
    return ApiTokenCreated(**record.fields(), token=secret)


@get("/api/v1/api-tokens", tags=["api-tokens"], opt=ADMIN, summary="API tokens (never their secrets)")
async def list_api_tokens(auth: AuthDep) -> ApiTokenList:
    table = await auth.table()
    return ApiTokenList(data=[ApiTokenView(**r.fields()) for r in table.records])


@delete("/api/v1/api-tokens/{token_id:str}", tags=["api-tokens"], status_code=200, opt=ADMIN,
        summary="Revoke an API token; api_open says whether that left the API open (no live token)")
async def revoke_api_token(auth: AuthDep, token_id: FromPath[str]) -> ApiTokenRevokedView:
    record = await auth.revoke(token_id)
    table = await auth.table()
    api_open = not auth.enforced(table)
    message = None
    if api_open:
        message = "No live API token is left: the API is open to anyone again (first-run mode)."
    elif table.live == 0:
        message = "No live API token is left: SWARM_REQUIRE_API_TOKEN keeps the API closed, but anyone may mint the " \
                  "first token."
    return ApiTokenRevokedView(**record.fields(), api_open=api_open, message=message)


TOKEN_ROUTES = [create_api_token, list_api_tokens, revoke_api_token]
