"""The operator console (docs/how-to/console.md): a few static files, served at /ui/.

The console is a page in the browser that reads and acts through the HTTP API only, with
the token the operator signs in with (kept in the tab's `sessionStorage`, sent in the
`Authorization` header of its own requests): these routes serve files, never data, so
they need no token, and the API refuses whatever the console would refuse.

Every file ships in the package (`supervisor/http/ui/`) and is read once, when the API is
built: no request names a file on disk. The assets are answered under a name carrying a
hash of their content, cached for a year; `index.html`, which names them, is never
cached, so a new version is picked up at the next load. Every address of a console page
(`/ui/sessions/<id>`, ...) answers `index.html`, and the page's script draws that page,
so any page can be opened directly and bookmarked. Each answer is gzipped once, up front,
for the clients that accept it.

Every /ui answer, an error too, forbids framing and carries a Content-Security-Policy that
lets the page load only its own scripts and styles and talk only to its own origin, with
no inline script or style at all.
"""

from __future__ import annotations

import gzip
import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from aiohttp import web

from supervisor.http.answers import error_response

PREFIX = "/ui"
PACKAGE = "supervisor.http"
FOLDER = "ui"
INDEX = "index.html"
ASSET_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
}
ASSET_NAME = r"[a-z]+\.[0-9a-f]{12}\.(js|css|svg)"
# The console's pages: each answers index.html, whose script draws it.
PAGES = re.compile(
    r"(overview|sessions(/[0-9a-f]{32})?|deliveries|tasks|schedules|boots)?/?",
)
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; manifest-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'self'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
YEAR = "public, max-age=31536000, immutable"


@dataclass(frozen=True)
class File:
    """One file as it is answered: plain and gzipped."""

    body: bytes
    gzipped: bytes
    content_type: str
    cache: str


def _file(body: bytes, content_type: str, cache: str) -> File:
    return File(body, gzip.compress(body, 9, mtime=0), content_type, cache)


def hashed_name(name: str, body: bytes) -> str:
    """`app.js` as `app.<12 hex of its sha256>.js`: a new content is a new address."""
    stem, dot, suffix = name.partition(".")
    return f"{stem}.{hashlib.sha256(body).hexdigest()[:12]}{dot}{suffix}"


def load() -> tuple[File, dict[str, File]]:
    """index.html (with each asset's hashed address written in) and the assets by hashed name.

    In index.html an asset is named `{{app.js}}`; an asset it names that the package does
    not hold fails here, when the API is built, not in an operator's browser.
    """
    folder = resources.files(PACKAGE).joinpath(FOLDER)
    assets: dict[str, File] = {}
    addresses: dict[str, str] = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.name == INDEX or suffix not in ASSET_TYPES:
            continue
        body = entry.read_bytes()
        name = hashed_name(entry.name, body)
        assets[name] = _file(body, ASSET_TYPES[suffix], YEAR)
        addresses[entry.name] = f"{PREFIX}/assets/{name}"
    template = folder.joinpath(INDEX).read_text(encoding="utf-8")

    def address(match: re.Match[str]) -> str:
        return addresses[match.group(1)]  # KeyError: index.html names a file not shipped

    page = re.sub(r"\{\{([a-z]+\.[a-z]+)\}\}", address, template)
    return _file(page.encode(), "text/html; charset=utf-8", "no-cache"), assets


class Console:
    """The /ui routes: the page at every console address, and its assets."""

    def __init__(self) -> None:
        self.index, self.assets = load()

    def add(self, app: web.Application) -> None:
        """Register the routes, and the headers every /ui answer carries."""
        r = app.router
        r.add_get(PREFIX, self.home)
        r.add_get(PREFIX + "/assets/{name}", self.asset)
        r.add_get(PREFIX + "/{path:.*}", self.page)
        app.on_response_prepare.append(self._headers)

    @staticmethod
    def public(path: str) -> bool:
        """Whether `path` is a console address (served without a token: files, no data)."""
        return path == PREFIX or path.startswith(PREFIX + "/")

    async def home(self, request: web.Request) -> web.StreamResponse:
        # Answered, not raised: the API's error middleware would make an exception a JSON error.
        return web.Response(status=308, text="Moved to /ui/", headers={"Location": PREFIX + "/"})

    async def page(self, request: web.Request) -> web.StreamResponse:
        if not PAGES.fullmatch(request.match_info["path"]):
            return error_response(404, "not_found", f"no console page {request.path!r}")
        return self._answer(request, self.index)

    async def asset(self, request: web.Request) -> web.StreamResponse:
        found = self.assets.get(request.match_info["name"])
        if found is None:
            return error_response(404, "not_found", f"no console file {request.path!r}")
        return self._answer(request, found)

    @staticmethod
    def _answer(request: web.Request, file: File) -> web.Response:
        headers = {"Cache-Control": file.cache, "Vary": "Accept-Encoding"}
        body = file.body
        if "gzip" in request.headers.get("Accept-Encoding", "").lower():
            body = file.gzipped
            headers["Content-Encoding"] = "gzip"
        headers["Content-Type"] = file.content_type
        return web.Response(body=body, headers=headers)

    @staticmethod
    async def _headers(request: web.Request, response: web.StreamResponse) -> None:
        if Console.public(request.path):
            response.headers.update(HEADERS)
