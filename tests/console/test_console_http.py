"""The console's routes over HTTP, without a browser: what /ui answers, with which headers,
and that the files ship in the package.

Every /ui answer (an error too) carries the strict Content-Security-Policy, X-Frame-Options
DENY, nosniff and no-referrer; the pages need no token and hold no data; every console
address answers the same index.html (never cached), which names its assets by a hash of
their content (cached for a year), gzipped for a client that accepts it.
"""

from __future__ import annotations

import fnmatch
import gzip
import re
import tomllib
from collections.abc import Callable
from importlib import resources

from supervisor.http import console
from tests.conftest import REPO
from tests.daemon import daemons
from tests.http.test_api import Api, assert_error, start

__all__ = ["daemons", "start"]  # the fixtures

SESSION = "0123456789abcdef0123456789abcdef"


def test_the_package_ships_every_file_of_the_console() -> None:
    folder = resources.files("supervisor.http").joinpath(console.FOLDER)
    names = sorted(entry.name for entry in folder.iterdir())
    assert {"index.html", "app.js", "app.css", "icon.svg"} <= set(names)
    shipped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["supervisor.http"]
    for name in names:
        assert any(fnmatch.fnmatch(f"ui/{name}", pattern) for pattern in shipped), name
    index, assets = console.load()
    page = index.body.decode()
    named = re.findall(r'(?:href|src)="(/ui/assets/[^"]+)"', page)
    assert sorted(named) == sorted(f"/ui/assets/{name}" for name in assets)
    assert "{{" not in page
    for name, file in assets.items():
        assert re.fullmatch(console.ASSET_NAME, name), name
        assert gzip.decompress(file.gzipped) == file.body
    # No inline script or style, nor a handler attribute, that the policy would block.
    assert not re.search(r"<script>|<style|\sstyle=|\son[a-z]+=", page)
    script = next(f.body.decode() for n, f in assets.items() if n.endswith(".js"))
    assert ".innerHTML" not in script and "insertAdjacentHTML" not in script
    assert "eval(" not in script and "document.cookie" not in script


def test_the_console_answers_its_pages_and_files_with_strict_headers(
    start: Callable[..., Api],
) -> None:
    api = start()
    anonymous = api.client(None)
    redirected = anonymous.get("/ui")
    assert redirected.status_code == 308 and redirected.headers["Location"] == "/ui/"
    index = anonymous.get("/ui/")
    assert index.status_code == 200 and index.headers["Content-Type"].startswith("text/html")
    assert index.headers["Cache-Control"] == "no-cache"
    for path in ("/ui/overview", "/ui/sessions", f"/ui/sessions/{SESSION}", "/ui/boots/"):
        page = anonymous.get(path)
        assert (page.status_code, page.content) == (200, index.content), path
    for answer in (index, redirected):
        assert answer.headers["Content-Security-Policy"] == console.CSP
        assert "script-src 'self';" in console.CSP and "frame-ancestors 'none'" in console.CSP
        assert answer.headers["X-Frame-Options"] == "DENY"
        assert answer.headers["X-Content-Type-Options"] == "nosniff"
        assert answer.headers["Referrer-Policy"] == "no-referrer"
    assets = re.findall(r'(?:href|src)="(/ui/assets/[^"]+)"', index.text)
    assert len(assets) == 3
    for path in assets:
        # httpx asks for gzip: the answer comes compressed, and decompressed it is the file.
        found = anonymous.get(path)
        assert found.status_code == 200, path
        assert found.headers["Content-Encoding"] == "gzip"
        assert found.headers["Cache-Control"] == "public, max-age=31536000, immutable"
        assert found.headers["Content-Security-Policy"] == console.CSP
        plain = anonymous.get(path, headers={"Accept-Encoding": "identity"})
        assert "Content-Encoding" not in plain.headers and plain.content == found.content
        assert int(found.headers["Content-Length"]) < len(plain.content)
    unknown = ("/ui/assets/app.000000000000.js", "/ui/nothing", "/ui/sessions/x", "/ui/tasks/1")
    for missing in unknown:
        gone = anonymous.get(missing)
        assert_error(gone, 404, "not_found")
        assert gone.headers["X-Frame-Options"] == "DENY", missing
    refused = anonymous.post("/ui/sessions")
    assert refused.status_code == 405 and refused.headers["X-Frame-Options"] == "DENY"
    # The files need no token; the data still does.
    assert_error(anonymous.get("/v1/sessions"), 401)


def test_the_console_can_be_turned_off(start: Callable[..., Api]) -> None:
    api = start(http={"console": False})
    admin = api.client("admin")
    assert_error(admin.get("/ui/"), 404, "not_found")
    assert "X-Frame-Options" not in admin.get("/ui/").headers
    assert_error(api.client(None).get("/ui/"), 401)
