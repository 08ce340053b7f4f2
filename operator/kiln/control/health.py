"""A standby's /healthz: it is alive, but holds no Lease and starts no watch (kopf serves the endpoint on the
same port once this process leads; kiln.control.serve)."""

from __future__ import annotations

from urllib.parse import urlparse


async def serve_standby(url: str):
    """Answer GET on url's path with {"standby": true}; returns the aiohttp runner (cleanup() stops it)."""
    from aiohttp import web

    parsed = urlparse(url)

    async def ok(_request):
        return web.json_response({"standby": True})

    app = web.Application()
    app.router.add_get(parsed.path or "/", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, parsed.hostname, parsed.port, reuse_address=True).start()
    return runner
