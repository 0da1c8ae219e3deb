"""The console application's typed keys, shared by its handlers."""

from __future__ import annotations

import asyncpg
import jinja2
from aiohttp import web

from service.ops.console import actions, refs, security

POOL = web.AppKey("pool", asyncpg.Pool)
ACTIONS = web.AppKey("actions", actions.Actions)
DOOR = web.AppKey("door", security.Door)
TEMPLATES = web.AppKey("templates", jinja2.Environment)
REF_KEY = web.AppKey("ref_key", refs.RefKey)


def operator_name(request: web.Request) -> str:
    """Who acts, as recorded: the session's or the bearer's name, marked as the console's."""
    operator = request.get(security.OPERATOR)
    return f"{operator.name if operator else 'anonymous'} (console)"
