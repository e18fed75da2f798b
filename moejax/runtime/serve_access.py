"""Who may call ``python -m moejax.serve``: the checks every request passes before any route runs.

A server on 127.0.0.1 is still reachable from every web page its user opens: a page may send a "simple" POST
(``Content-Type: text/plain``, no preflight) to ``http://127.0.0.1:8000``, and a page whose domain re-resolves
to 127.0.0.1 (DNS rebinding) may even read the replies. So, in this order:

* **Host**: a server bound to a loopback address answers only requests addressed to a loopback name
  (``localhost``, ``127.x.x.x``, ``[::1]``): a rebinding page's requests carry its own domain;
* **Origin**: a browser's request from another origin is refused unless ``--cors-origins`` lists it (then the
  CORS headers and the ``OPTIONS`` preflight are answered); the server's own pages (the dashboard) are its
  origin;
* **key**: with ``--api-key`` (or ``MOEJAX_API_KEY``), every route but ``/health`` and the dashboard's page
  needs ``Authorization: Bearer KEY``, as the OpenAI clients send it (401 otherwise);
* **body**: a POST must say ``Content-Type: application/json`` (415 otherwise): the one kind of body a page
  cannot send without a preflight.

Refusals are OpenAI error objects, like every other error of the server.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import json
import os
from urllib.parse import urlsplit

#: routes that answer without the key: liveness, and the dashboard's page (it asks for the key to call the rest)
PUBLIC_PATHS = ("/health", "/")
API_KEY_ENV = "MOEJAX_API_KEY"


@dataclasses.dataclass(frozen=True)
class Access:
    """The server's access rules (``serve`` builds them from its command line)."""

    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()  # exact origins ("http://host:port"), or "*" for any
    loopback_only: bool = True  # accept only loopback Host values (the default when bound to loopback)

    def allows_origin(self, origin: str) -> bool:
        return "*" in self.cors_origins or origin.rstrip("/").lower() in self.cors_origins


def is_loopback_name(host: str) -> bool:
    """``host`` (a Host header's name, without the port) names this machine's loopback interface."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name part of a Host header (``[::1]:8000`` -> ``[::1]``, ``localhost:8000`` -> ``localhost``)."""
    if host_header.startswith("["):
        return host_header[:host_header.find("]") + 1] if "]" in host_header else host_header
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def parse_origins(text: str | None) -> tuple[str, ...]:
    """``--cors-origins``: comma-separated origins such as ``http://localhost:3000``, or ``*``."""
    if not text:
        return ()
    out = []
    for item in text.split(","):
        item = item.strip().rstrip("/").lower()
        if not item:
            continue
        if item != "*":
            parts = urlsplit(item)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query:
                raise ValueError(f"--cors-origins: {item!r} is not an origin (scheme://host[:port], e.g. "
                                 "http://localhost:3000) or '*'")
        out.append(item)
    if not out:
        raise ValueError("--cors-origins is empty")
    return tuple(out)


def access_from_args(host: str, api_key: str | None, cors_origins: str | None) -> Access:
    """The rules for a server bound to ``host``: ``--api-key`` or else ``MOEJAX_API_KEY``; loopback Host values
    only when ``host`` is a loopback address."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and (not key.strip() or any(c.isspace() for c in key) or not key.isprintable()):
        raise ValueError("--api-key must be non-empty printable text without spaces")
    return Access(api_key=key, cors_origins=parse_origins(cors_origins), loopback_only=is_loopback_name(host))


def refusal(access: Access, method: str, path: str, headers: dict[str, str]) -> tuple[int, str, str] | None:
    """Why a request may not be served: (HTTP status, message, OpenAI error code), or None to serve it.
    ``headers``: lower-case names."""
    host = headers.get("host", "")
    if access.loopback_only and not is_loopback_name(host_name(host)):
        return (403, f"Host {host!r} is not this server's: a server bound to loopback answers requests to "
                     "localhost, 127.0.0.1 or [::1] only (bind with --host to serve other names)", "forbidden_host")
    origin = headers.get("origin")
    if origin is not None and not _same_origin(origin, host) and not access.allows_origin(origin):
        return (403, f"Origin {origin!r} may not call this server (start it with --cors-origins {origin} to "
                     "allow that page)", "forbidden_origin")
    if method == "OPTIONS":  # a preflight that reached the routes: not a CORS origin of ours
        return None
    if access.api_key is not None and path not in PUBLIC_PATHS:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), access.api_key.encode()):
            return 401, "this server needs an API key: send 'Authorization: Bearer KEY'", "invalid_api_key"
    if method == "POST":
        kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            return (415, f"the request body must be JSON, sent with 'Content-Type: application/json' (got "
                         f"{kind or 'none'!r})", "unsupported_media_type")
    return None


def _same_origin(origin: str, host: str) -> bool:
    parts = urlsplit(origin.strip())
    return parts.scheme in ("http", "https") and bool(host) and parts.netloc.lower() == host.strip().lower()


class AccessGuard:
    """An ASGI app behind ``refusal`` (pure ASGI, so streamed replies pass through untouched); FastAPI's
    ``app.add_middleware(AccessGuard, access=...)``."""

    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        why = refusal(self.access, scope["method"], scope["path"], headers)
        if why is None:
            return await self.app(scope, receive, send)
        status, message, code = why
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
        extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), *extra]})
        await send({"type": "http.response.body", "body": body})
