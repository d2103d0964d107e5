"""Cross-origin requests (CORS) for browser clients, as vLLM's server allows them (its defaults:
any origin, method and header; no credentials; ``--allowed-origins`` etc. narrow them).

    policy = CorsPolicy(allowed_origins=["https://app.example"], allow_credentials=True)
    policy.install(app)           # an aiohttp Application, before it starts

A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered here,
before routing and the API-key check: 200 with the allowed origin, methods and headers (max age
600 s), or 400 when the origin, method or a header is not allowed. Every other response to a
request with an allowed ``Origin`` gets ``Access-Control-Allow-Origin`` (``*`` when any origin is
allowed without credentials, else the origin itself, with ``Vary: Origin``) and, with
credentials, ``Access-Control-Allow-Credentials``: added as the response is prepared, so streamed
answers carry them too. A request without ``Origin`` is not touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

MAX_AGE_S = 600


@dataclass(frozen=True)
class CorsPolicy:
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    def __post_init__(self):
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, list) or any(not isinstance(item, str) or not item for item in value):
                raise ValueError(f"{name}: expected a list of non-empty strings, got {value!r:.100}")
        if not isinstance(self.allow_credentials, bool):
            raise ValueError(f"allow_credentials: expected a bool, got {self.allow_credentials!r}")

    def _origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def _origin_headers(self, origin: str) -> dict[str, str]:
        if "*" in self.allowed_origins and not self.allow_credentials:
            return {"Access-Control-Allow-Origin": "*"}
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def _preflight(self, request: web.Request) -> web.Response:
        origin = request.headers["Origin"]
        method = request.headers["Access-Control-Request-Method"].upper()
        asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
        methods = [m.upper() for m in self.allowed_methods]
        allowed_headers = {h.lower() for h in self.allowed_headers}
        refused = []
        if not self._origin_allowed(origin):
            refused.append("origin")
        if "*" not in methods and method not in methods:
            refused.append("method")
        if "*" not in allowed_headers and any(h.lower() not in allowed_headers for h in asked):
            refused.append("headers")
        if refused:
            return web.Response(status=400, text=f"Disallowed CORS {', '.join(refused)}")
        headers = {**self._origin_headers(origin), "Access-Control-Max-Age": str(MAX_AGE_S),
                   "Access-Control-Allow-Methods": ", ".join(
                       ["DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT"] if "*" in methods else methods)}
        if asked:
            headers["Access-Control-Allow-Headers"] = ", ".join(asked if "*" in allowed_headers else
                                                               self.allowed_headers)
        return web.Response(status=200, headers=headers)

    def install(self, app: web.Application) -> None:
        """Answer preflights ahead of ``app``'s other middlewares; mark its responses."""
        @web.middleware
        async def preflight(request: web.Request, handler):
            if (request.method == "OPTIONS" and "Origin" in request.headers
                    and "Access-Control-Request-Method" in request.headers):
                return self._preflight(request)
            return await handler(request)

        async def mark(request: web.Request, response: web.StreamResponse) -> None:
            origin = request.headers.get("Origin")
            if origin is not None and self._origin_allowed(origin):
                response.headers.update(self._origin_headers(origin))

        app.middlewares.insert(0, preflight)
        app.on_response_prepare.append(mark)
