"""The API server's HTTP gauges for live telemetry (glass, not vLLM's path).

``InFlightCounter`` is the outermost middleware of ``app.build_app``: it counts HTTP requests
from arrival until their response is sent, and ``api_server`` publishes that count as the
``api.http_in_flight`` gauge (``tracing.telemetry.events.GAUGE_API_IN_FLIGHT``). vLLM has no
counterpart (its ``vllm:num_requests_running`` counts engine requests, not HTTP ones).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class InFlightCounter:
    """Counts HTTP requests from arrival until their response is sent (streams included):
    the API server's ``api.http_in_flight`` gauge. Pure ASGI."""

    class Count:
        value = 0

    def __init__(self, app: ASGIApp, count: Count) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.count.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count.value -= 1
