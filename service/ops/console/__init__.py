"""``relay console``: the operator console (server-rendered pages and a JSON API).

``app`` builds the aiohttp application from its dependencies, ``security`` owns the
token, the session cookie, CSRF and the response headers, ``data`` reads through named
SQL blocks (pages and API share it), ``actions`` changes state through the same ledger
and replay functions as the CLI, ``pages`` and ``api`` are the handlers, ``run`` is the
composition root.
"""
