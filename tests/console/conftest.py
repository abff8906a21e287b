"""The console's browser: Debian's headless Chromium, driven by Selenium through chromedriver.

Both come from Debian's `chromium` and `chromium-driver` packages (.ci/run installs them);
the driver is named explicitly, so Selenium never looks for (or downloads) one of its own.
Without them the browser tests skip, naming the package, unless
TURNKEEPER_TEST_REQUIRE_BROWSER is set (CI), where they fail instead.

Screenshots go to the folder TURNKEEPER_SCREENSHOTS names (the README's images are made
with `TURNKEEPER_SCREENSHOTS=docs/images/console`), else to the test's tmp folder; either
way each is checked to be a real picture, not a blank page.
"""

from __future__ import annotations

import os
import shutil
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

REQUIRED = "TURNKEEPER_TEST_REQUIRE_BROWSER"
SHOTS = "TURNKEEPER_SCREENSHOTS"
WIDTHS = {"wide": (1280, 860), "phone": (390, 844)}
WAIT_S = 30.0  # a bound on waiting for what must happen, not a measure of speed


def _found(name: str, *places: str) -> str | None:
    return shutil.which(name) or next((p for p in places if os.access(p, os.X_OK)), None)


def browser_paths() -> tuple[str | None, str | None]:
    """Where Debian's chromium and chromedriver are, if they are."""
    return _found("chromium", "/usr/bin/chromium"), _found("chromedriver", "/usr/bin/chromedriver")


def require_browser() -> tuple[str, str]:
    """Chromium's and chromedriver's paths; skip (or fail, where CI requires them) if absent."""
    chromium, driver = browser_paths()
    missing = [
        f"Debian's {package} (apt-get install {package})"
        for package, path in (("chromium", chromium), ("chromium-driver", driver))
        if path is None
    ]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e '.[test]')")
    if missing:
        why = f"the console's browser tests need {' and '.join(missing)}"
        if os.environ.get(REQUIRED):
            pytest.fail(f"{REQUIRED} is set, but {why}")
        pytest.skip(why)
    assert chromium is not None and driver is not None
    return chromium, driver


class Browser:
    """One headless Chromium window, and what the tests ask of it."""

    def __init__(self, driver: Any, shots: Path) -> None:
        self.driver = driver
        self.shots = shots

    def open(self, base_url: str, path: str, token: str | None = None) -> None:
        """Open `path` of the console, signed in with `token` through `#token=`."""
        self.driver.get(f"{base_url}{path}" + (f"#token={token}" if token else ""))

    def find(self, css: str, timeout: float = WAIT_S) -> Any:
        """The first element `css` names, once there is one."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout).until(
            lambda d: (d.find_elements(By.CSS_SELECTOR, css) or [None])[0],
            f"no element {css!r} on {self.driver.current_url}",
        )

    def all(self, css: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        found: list[Any] = self.driver.find_elements(By.CSS_SELECTOR, css)
        return found

    def until(self, predicate: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(
            lambda _: predicate(), f"timed out waiting for {what}"
        )

    def text(self) -> str:
        return str(self.driver.execute_script("return document.body.innerText"))

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def dark(self, on: bool) -> None:
        """Emulate `prefers-color-scheme: dark` (or light)."""
        value = "dark" if on else "light"
        self.driver.execute_cdp_cmd(
            "Emulation.setEmulatedMedia",
            {"features": [{"name": "prefers-color-scheme", "value": value}]},
        )

    def screenshots(self, name: str, dark: bool = False) -> list[Path]:
        """The page as it is now at a laptop's and a phone's width: PNGs, checked not blank."""
        made = []
        for label, (width, height) in WIDTHS.items():
            self.driver.set_window_size(width, height)
            self.until(
                lambda width=width: self.js("return window.innerWidth") <= width, "the width"
            )
            # The whole page, up to a few screens: what a reader of the docs scrolls through.
            tall = self.js("return document.documentElement.scrollHeight")
            self.driver.set_window_size(width, min(max(height, tall + 90), 3 * height))
            self.js("window.scrollTo(0, 0)")
            path = self.shots / f"{name}-{label}{'-dark' if dark else ''}.png"
            assert self.driver.save_screenshot(str(path)), path
            assert png_colors(path) >= 8, f"{path} looks blank"
            made.append(path)
        self.driver.set_window_size(*WIDTHS["wide"])
        return made


def png_colors(path: Path) -> int:
    """How many distinct colours the PNG at `path` has (8-bit RGB or RGBA, not interlaced)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    at, chunks, header = 8, [], b""
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind = data[at + 4 : at + 8]
        body = data[at + 8 : at + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        at += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
    size = 4 if colour == 6 else 3
    raw = zlib.decompress(b"".join(chunks))
    stride = width * size
    previous = bytearray(stride)
    colours: set[bytes] = set()
    for row in range(min(height, 400)):  # the top of the page tells a blank one
        start = row * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = line[i - size] if i >= size else 0
            up = previous[i]
            corner = previous[i - size] if i >= size else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                guess = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + guess) & 0xFF
        if row % 4 == 0:  # a sample of the rows is enough
            colours.update(bytes(line[i : i + size]) for i in range(0, stride, size * 4))
        previous = line
    return len(colours)


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where screenshots go: TURNKEEPER_SCREENSHOTS (relative to the checkout), else tmp."""
    named = os.environ.get(SHOTS)
    folder = (REPO / named) if named else tmp_path / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def chromium(chromium_path: str, driver_path: str, folder: Path) -> Any:
    """A headless Chromium with its own profile in `folder`, driven through `driver_path`
    (named, so Selenium Manager never fetches a driver of its own)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium_path
    for argument in (
        "--headless=new",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={folder / 'chromium'}",
        "--window-size=1280,860",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(argument)
    if os.geteuid() == 0:
        options.add_argument("--no-sandbox")  # Chromium refuses its sandbox as root
    service = Service(executable_path=driver_path, log_output=str(folder / "chromedriver.log"))
    return webdriver.Chrome(service=service, options=options)


@pytest.fixture
def browser(tmp_path: Path, shots: Path) -> Iterator[Browser]:
    """A headless Chromium of this test's own (its own profile), closed after it."""
    driver = chromium(*require_browser(), tmp_path)
    try:
        yield Browser(driver, shots)
    finally:
        driver.quit()
