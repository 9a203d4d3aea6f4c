"""Web pages and their JSON: chat, dashboard, performance."""

from leader.web.api import ROUTES as API_ROUTES
from leader.web.pages import ROUTES as PAGE_ROUTES

ROUTES = [*PAGE_ROUTES, *API_ROUTES]
