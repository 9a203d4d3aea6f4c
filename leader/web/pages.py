"""The web pages (chat and dashboard) and their static files; the pages hold no data, the JSON API does."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape
from litestar import Response, get
from litestar.connection import ASGIConnection
from litestar.datastructures import CacheControlHeader
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath
from litestar.response import Redirect
from litestar.static_files import create_static_files_router

from leader.errors import ApiError

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
STATIC = ROOT / "static"
# A local install has one owner and one pool; the paths keep the spec's shape for a hosted one.
OWNER, POOL = "local", "default"
PAGES = {"inference": "Chat", "dashboard": "Dashboard"}
STATIC_NAMES = frozenset(p.name for p in STATIC.iterdir() if p.suffix in (".css", ".js"))  # what pages link to

_env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]),
                   trim_blocks=True, lstrip_blocks=True)


@lru_cache(maxsize=1)
def static_version() -> str:
    """A digest of the static files, appended to their URLs so a new release is never served stale."""
    digest = hashlib.sha256()
    for name in sorted(STATIC_NAMES):
        digest.update(name.encode() + (STATIC / name).read_bytes())
    return digest.hexdigest()[:12]


def render(page: str, owner: str, pool: str) -> Response:
    if (owner, pool) != (OWNER, POOL):
        raise ApiError(404, f"No pool '{owner}/{pool}' here; this leader serves '{OWNER}/{POOL}'",
                       code="pool_not_found")
    html = _env.get_template(f"{page}.html").render(
        page=page, title=PAGES[page], pages=PAGES, owner=owner, pool=pool, base=f"/pools/{owner}/{pool}",
        v=static_version())
    return Response(html, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})


@get("/", opt={"scope": "public"}, include_in_schema=False)
async def root() -> Redirect:
    return Redirect(f"/pools/{OWNER}/{POOL}/inference")


@get("/pools/{owner:str}/{pool:str}/inference", opt={"scope": "public"}, include_in_schema=False)
async def inference_page(owner: FromPath[str], pool: FromPath[str]) -> Response:
    return render("inference", owner, pool)


@get("/pools/{owner:str}/{pool:str}/dashboard", opt={"scope": "public"}, include_in_schema=False)
async def dashboard_page(owner: FromPath[str], pool: FromPath[str]) -> Response:
    return render("dashboard", owner, pool)


async def known_static_file(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Any name but a file the pages use is a 404 before the file system sees it (a NUL, a huge name)."""
    if str(connection.path_params.get("file_path", "")).lstrip("/") not in STATIC_NAMES:
        raise ApiError(404, "No such static file", code="not_found")


static_files = create_static_files_router(
    path="/static", directories=[STATIC], opt={"scope": "public"}, guards=[known_static_file],
    cache_control=CacheControlHeader(max_age=86400, public=True))

ROUTES = [root, inference_page, dashboard_page, static_files]
