"""CORS for the proxy: browsers on the configured origins may call it."""

from __future__ import annotations

from aiohttp import web


def cors(origins: tuple[str, ...]):
    """Browsers on `origins` ("*": any) may call the endpoint: their preflight is answered and every
    answer names the origin. No origin configured: no CORS header at all."""
    @web.middleware
    async def middleware(request: web.Request, handler):
        origin = request.headers.get("Origin")
        allowed = origin is not None and ("*" in origins or origin in origins)
        if request.method == "OPTIONS" and allowed and request.headers.get("Access-Control-Request-Method"):
            resp = web.Response(status=204)
        else:
            resp = await handler(request)
        if allowed:
            resp.headers.update({"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                                 "Access-Control-Allow-Headers": "Authorization, Content-Type",
                                 "Access-Control-Allow-Methods": "GET, POST, OPTIONS"})
        return resp
    return middleware
