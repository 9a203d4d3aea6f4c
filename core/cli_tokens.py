"""`swarm tokens create|list|revoke`: API tokens through the leader's /api/v1/api-tokens."""

from __future__ import annotations

import sys
import time

from core.cli_errors import CliError
from core.settings import Settings
from events.api_tokens import unprintable

TIMEOUT_S = 30.0


def call_leader(settings: Settings, method: str, path: str, body: dict | None = None,
                timeout: float = TIMEOUT_S) -> dict:
    """One request to SWARM_LEADER_URL with SWARM_API_TOKEN as bearer; any failure is a CliError."""
    import httpx

    headers = {"Authorization": f"Bearer {settings.leader.api_token}"} if settings.leader.api_token else {}
    url = settings.leader.url + path
    try:
        resp = httpx.request(method, url, json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the leader at {settings.leader.url}: {exc or type(exc).__name__}") from None
    try:
        data = resp.json()
    except ValueError:
        data = None
    if resp.status_code >= 400:
        err = data.get("error") if isinstance(data, dict) else None
        message = err.get("message") if isinstance(err, dict) else resp.text.strip()[:200]
        raise CliError(f"leader answered {resp.status_code}: {message or resp.reason_phrase}")
    if not isinstance(data, dict):
        raise CliError(f"leader answered {resp.status_code} without a JSON object")
    return data


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _state(token: dict, now: float) -> str:
    if token.get("revoked_at") is not None:
        return "revoked"
    if token.get("expires_at") is not None and now >= token["expires_at"]:
        return "expired"
    return "active"


def cmd_create(args) -> int:
    body = {"label": args.label, "scopes": args.scope}
    if args.expires_in is not None:
        body["expires_in"] = args.expires_in
    token = call_leader(Settings.from_env(), "POST", "/api/v1/api-tokens", body)
    print(token["token"], flush=True)  # the only time the secret is shown; alone on stdout for scripts
    print(f"token {token['id']} ({printable(token['label'])}; scopes {', '.join(token['scopes'])}; "
          f"expires {_when(token.get('expires_at'))}): store it now, it is not shown again",
          file=sys.stderr)
    return 0


def printable(text: str) -> str:
    """`text` with controls and formatting characters escaped (a label minted before the leader refused
    them): a terminal shows them as \\uXXXX rather than obeying them."""
    return "".join(f"\\u{ord(c):04x}" if unprintable(c) else c for c in text)


def cmd_list(args) -> int:
    tokens = call_leader(Settings.from_env(), "GET", "/api/v1/api-tokens")["data"]
    now = time.time()
    rows = [("ID", "LABEL", "SCOPES", "PREFIX", "CREATED", "EXPIRES", "STATE")]
    rows += [(t["id"], printable(t["label"]), ",".join(t["scopes"]), t["prefix"], _when(t["created_at"]),
              _when(t.get("expires_at")), _state(t, now)) for t in tokens]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


def _live(token: dict) -> bool:
    """Unrevoked, expired or not: the leader counts it as keeping auth on (leader.auth.registry)."""
    return token.get("revoked_at") is None


def cmd_revoke(args) -> int:
    settings = Settings.from_env()
    if not args.force:
        tokens = call_leader(settings, "GET", "/api/v1/api-tokens")["data"]
        others = [t for t in tokens if _live(t) and t["id"] != args.token_id]
        if any(t["id"] == args.token_id and _live(t) for t in tokens) and not others:
            raise CliError(f"{args.token_id} is the last live token: revoking it opens the API to anyone; "
                           "pass --force to revoke it anyway")
    token = call_leader(settings, "DELETE", f"/api/v1/api-tokens/{args.token_id}")
    print(f"revoked {token['id']} ({printable(token['label'])}, {token['prefix']}...)")
    if token.get("message"):
        print(token["message"], file=sys.stderr)
    return 0


def add_commands(sub) -> None:
    tokens = sub.add_parser("tokens", help="mint, list and revoke API tokens")
    verbs = tokens.add_subparsers(dest="tokens_command", required=True)
    create = verbs.add_parser("create", help="mint a token and print its secret once")
    create.add_argument("--label", required=True, help="a name for the token (printable text)")
    create.add_argument("--scope", action="append", required=True, help="read, operate or admin (repeatable)")
    create.add_argument("--expires-in", type=float, default=None, metavar="SECONDS",
                        help="lifetime (default: never expires)")
    create.set_defaults(func=cmd_create)
    verbs.add_parser("list", help="list tokens (never their secrets)").set_defaults(func=cmd_list)
    revoke = verbs.add_parser("revoke", help="revoke a token by id")
    revoke.add_argument("token_id", metavar="ID", help="the token's id (from `swarm tokens list`)")
    revoke.add_argument("--force", action="store_true", help="revoke even the last live token (reopens the API)")
    revoke.set_defaults(func=cmd_revoke)
