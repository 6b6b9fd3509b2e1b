"""The documentation site: built strictly, self-contained, and rendered correctly in a browser.

This module is where `make test` builds the site (`mkdocs build --strict`, every notebook
executed); the Makefile does not build it a second time. The static checks always run. The
browser checks drive headless Chromium over the Chrome DevTools Protocol and skip when no
`chromium` is on PATH (`.ci/run` installs Debian's).
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "build" / "screenshots"

# All tests here share one build: keep them on one xdist worker (make test uses --dist loadgroup).
pytestmark = [pytest.mark.xdist_group("site"), pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log = ROOT / "build" / "mkdocs-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        pytest.fail(f"mkdocs build --strict failed (full log: {log}):\n" + "\n".join(lines[-60:]), pytrace=False)
    return out


def html_pages(site: Path) -> list[Path]:
    return sorted(site.rglob("*.html"))


def page_url(site: Path, page: Path) -> str:
    """The page's path on the server, as a browser would request it."""
    rel = page.relative_to(site).as_posix()
    return "/" + (rel[: -len("index.html")] if rel.endswith("index.html") else rel)


class _Tags(HTMLParser):
    """Collects the attributes of every tag, and every element id, of one HTML page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = {k: v or "" for k, v in attrs}
        self.tags.append((tag, attrs))
        for key in ("id", "name"):
            if attrs.get(key):
                self.ids.add(attrs[key])


@functools.lru_cache(maxsize=None)
def parse(page: Path) -> _Tags:
    parser = _Tags()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def target_file(site: Path, path: str) -> Path | None:
    """The built file a site-absolute URL path is served from, or None."""
    candidate = site / unquote(path).lstrip("/")
    if candidate.is_dir():
        candidate = candidate / "index.html"
    return candidate if candidate.is_file() else None


def test_build_has_every_page(site):
    assert (site / "index.html").is_file()
    assert (site / "conventions" / "index.html").is_file()
    assert (site / "vendor" / "katex" / "katex.min.js").is_file()
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        assert (site / "notebooks" / nb.stem / "index.html").is_file(), f"no page for {nb.name}"


def test_internal_links_resolve(site):
    broken = []
    for page in html_pages(site):
        base = page_url(site, page)
        for tag, attrs in parse(page).tags:
            href = attrs.get("href")
            if tag != "a" or not href:
                continue
            parts = urlsplit(urljoin(base, href))
            if parts.scheme or parts.netloc:  # an external link: a reader may follow it, the page loads nothing
                continue
            target = target_file(site, parts.path)
            if target is None:
                broken.append(f"{page_url(site, page)}: {href} (no such file)")
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in parse(target).ids:
                broken.append(f"{page_url(site, page)}: {href} (no anchor #{parts.fragment})")
    assert not broken, "broken internal links:\n" + "\n".join(broken)


# Attributes through which a page loads something (as opposed to <a href>, which it only links).
_LOADING = {"script": "src", "img": "src", "iframe": "src", "source": "src", "audio": "src", "video": "src",
            "embed": "src", "object": "data"}


def test_pages_reference_nothing_outside_the_site(site):
    external = []
    for page in html_pages(site):
        for tag, attrs in parse(page).tags:
            urls = []
            if tag in _LOADING:
                urls.append(attrs.get(_LOADING[tag], ""))
            if tag == "link" and attrs.get("rel", "") not in ("canonical", "alternate"):
                urls.append(attrs.get("href", ""))
            for url in urls:
                if re.match(r"^(https?:)?//", url):
                    external.append(f"{page_url(site, page)}: <{tag}> {url}")
    assert not external, "pages load from outside the site:\n" + "\n".join(external)


def test_katex_css_names_only_shipped_fonts(site):
    css = (site / "vendor" / "katex" / "katex.min.css").read_text()
    urls = set(re.findall(r"url\(([^)]+)\)", css))
    assert urls, "katex.min.css names no fonts"
    missing = sorted(u for u in urls if not (site / "vendor" / "katex" / u.strip("'\"")).is_file())
    assert not missing, f"katex.min.css names files that are not shipped: {missing}"


# --------------------------------------------------------------------------------------------
# Browser checks


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class Chromium:
    """Headless Chromium driven over the DevTools Protocol: one page, one websocket."""

    FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run",
             "--disable-extensions", "--disable-default-apps", "--mute-audio", "--hide-scrollbars"]

    def __init__(self, binary: str):
        import websocket  # websocket-client, from the test extra

        self.profile = tempfile.mkdtemp(prefix="dsa-ref-chromium-")
        self.log = open(Path(self.profile) / "chromium.log", "wb")
        self.proc = subprocess.Popen(
            [binary, *self.FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=self.log, stderr=subprocess.STDOUT)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.is_file() and len(port_file.read_text().split()) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start; see {self.log.name}")
            time.sleep(0.1)
        port, path = port_file.read_text().split()[:2]
        self.ws = websocket.create_connection(f"ws://127.0.0.1:{port}{path}", timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True,
                  width=1280, height=900, deviceScaleFactor=1, mobile=False)

    def _receive(self, timeout: float) -> dict | None:
        import websocket

        self.ws.settimeout(timeout)
        try:
            message = json.loads(self.ws.recv())
        except websocket.WebSocketTimeoutException:
            return None
        if "id" not in message:
            self.events.append(message)
        return message

    def call(self, method: str, session: bool = False, **params):
        self.next_id += 1
        request = {"id": self.next_id, "method": method, "params": params}
        if session:
            request["sessionId"] = self.session
        self.ws.send(json.dumps(request))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            message = self._receive(timeout=deadline - time.monotonic())
            if message and message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
        raise TimeoutError(method)

    def visit(self, url: str, settle: float = 1.0) -> list[dict]:
        """Load url; return every event seen until the page is loaded and quiet for `settle` s."""
        self.events = []
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + 60
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load")
            self._receive(timeout=1.0)
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < settle and time.monotonic() < deadline:
            if self._receive(timeout=0.2) is not None:
                quiet_since = time.monotonic()
        return list(self.events)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def resize(self, width: int, height: int = 900):
        """Set the window's size in CSS pixels (the pages re-lay out; call visit afterwards)."""
        self.call("Emulation.setDeviceMetricsOverride", session=True,
                  width=width, height=height, deviceScaleFactor=1, mobile=False)

    def screenshot(self, path: Path):
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self):
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.log.close()
            shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium); browser checks skipped")
    chromium = Chromium(binary)
    yield chromium
    chromium.close()


def problems_in(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions, failed loads and requests to other hosts."""
    problems = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            problems.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            problems.append(f"exception: {details.get('exception', {}).get('description') or details.get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            problems.append(f"log error: {entry.get('text')} {entry.get('url', '')}")
        elif method == "Network.requestWillBeSent":
            url = params["request"]["url"]
            parts = urlsplit(url)
            if parts.scheme in ("data", "blob", "about"):
                continue
            if parts.scheme not in ("http", "https", "ws", "wss") or parts.hostname != "127.0.0.1":
                problems.append(f"request outside 127.0.0.1: {url}")
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            problems.append(f"load failed: {params.get('errorText')} ({params.get('type')})")
        elif method == "Network.responseReceived" and params["response"]["status"] >= 400:
            problems.append(f"HTTP {params['response']['status']}: {params['response']['url']}")
    return problems


# Math still left as source after KaTeX ran: arithmatex elements without a rendering, and dollar
# or bracket delimiters left in notebook markdown (code and rendered math removed first).
_MATH_STATE = r"""(() => {
  const raw = [];
  for (const el of document.querySelectorAll('.arithmatex')) {
    if (!el.querySelector('.katex')) raw.push(el.textContent.trim().slice(0, 80));
  }
  for (const el of document.querySelectorAll('.jupyter-wrapper .jp-RenderedMarkdown')) {
    const copy = el.cloneNode(true);
    copy.querySelectorAll('.katex, pre, code').forEach(n => n.remove());
    const text = copy.textContent;
    if (/\$\$|\\\(|\\\[|\$[^\s$][^$]*\$/.test(text)) raw.push(text.trim().slice(0, 80));
  }
  return {katex: document.querySelectorAll('.katex').length,
          errors: document.querySelectorAll('.katex-error').length, raw};
})()"""


def has_math(page: Path) -> bool:
    html = page.read_text(encoding="utf-8")
    if 'class="arithmatex"' in html:
        return True
    # notebook markdown cells keep the author's $...$ as text (scripts and styles may hold a '$' too)
    text = re.sub(r"<(script|style)\b.*?</\1>", "", html, flags=re.S)
    return "jp-RenderedMarkdown" in text and re.search(r"\$[^$<>\s][^$<>]*\$", text) is not None


def test_every_page_in_chromium(site, server, browser):
    failures = []
    checked_math = 0
    for page in html_pages(site):
        url = server + page_url(site, page)
        events = browser.visit(url)
        problems = problems_in(events)
        if has_math(page):
            checked_math += 1
            state = browser.evaluate(_MATH_STATE)
            if state["katex"] == 0:
                problems.append("page has math but KaTeX rendered none")
            if state["errors"]:
                problems.append(f"{state['errors']} KaTeX error(s)")
            problems += [f"math left as source: {text!r}" for text in state["raw"]]
        failures += [f"{page_url(site, page)}: {p}" for p in problems]
    assert checked_math > 0, "no page with math was found; the conventions page has some"
    assert not failures, "\n".join(failures)


# Code that runs off the side of its box: every <pre> of a notebook code cell (input and text
# output) whose content is wider than the box, and whether the page itself scrolls sideways.
_CODE_OVERFLOW = r"""(() => {
  const wide = [];
  const blocks = document.querySelectorAll('.jupyter-wrapper .jp-CodeCell pre');
  for (const el of blocks) {
    if (el.scrollWidth > el.clientWidth + 1) {
      wide.push(`${el.scrollWidth} > ${el.clientWidth} px: ${el.textContent.trim().split('\n')[0].slice(0, 60)}`);
    }
  }
  const root = document.documentElement;
  return {blocks: blocks.length, wide, page: root.scrollWidth > root.clientWidth + 1};
})()"""

# Entries of the page's table of contents that still hold LaTeX source ($, \(, \frac{...}).
_TOC_RAW_LATEX = r"""Array.from(document.querySelectorAll('.md-nav--secondary .md-nav__link'))
  .map(a => a.textContent.trim())
  .filter(t => /\$|\\[(\[]|\\[A-Za-z]+\{|\^\{|_\{/.test(t))"""

# The widths at which notebook code must fit: a laptop window, and a narrower one (Material's
# right-hand table of contents is hidden below 1220 px, its navigation below 960 px).
WIDTHS = (1400, 1000)


def test_notebook_code_cells_fit_without_sideways_scrolling(site, server, browser):
    """Every code cell of every notebook page fits its column at 1400 px and at 1000 px."""
    pages = sorted((site / "notebooks").glob("*/index.html"))
    assert pages, "no notebook pages"
    failures, checked = [], 0
    try:
        for width in WIDTHS:
            browser.resize(width)
            for page in pages:
                browser.visit(server + page_url(site, page), settle=0.3)
                state = browser.evaluate(_CODE_OVERFLOW)
                checked += state["blocks"]
                where = f"{page_url(site, page)} at {width} px"
                failures += [f"{where}: {w}" for w in state["wide"]]
                if state["page"]:
                    failures.append(f"{where}: the page scrolls sideways")
    finally:
        browser.resize(1280)
    assert checked > 0, "no code cells found on the notebook pages"
    assert not failures, "code wider than its column:\n" + "\n".join(failures)


def test_no_raw_latex_in_tables_of_contents(site, server, browser):
    """Headings with math give plain-text TOC entries (`{ data-toc-label="..." }` on the heading)."""
    failures = []
    for page in html_pages(site):
        browser.visit(server + page_url(site, page), settle=0.2)
        failures += [f"{page_url(site, page)}: {entry!r}" for entry in browser.evaluate(_TOC_RAW_LATEX)]
    assert not failures, "LaTeX source in a table of contents:\n" + "\n".join(failures)


def test_toc_check_sees_raw_latex():
    """The pattern above matches what a heading with math leaves in a TOC, and not plain text."""
    import re as re_

    pattern = re_.compile(r"\$|\\[(\[]|\\[A-Za-z]+\{|\^\{|_\{")
    for raw in (r"The softmax scale stays \(m^2/\sqrt{192}\)", "What a small $k$ costs", r"\frac{a}{b}"):
        assert pattern.search(raw), raw
    for plain in ("The softmax scale stays m²/√192", "What a small k costs in accuracy", "4.2 Context parallelism"):
        assert not pattern.search(plain), plain


def test_screenshots(site, server, browser):
    """Landing page, a chapter and the notebooks, for a person to look at (build/screenshots/)."""
    browser.visit(server + "/")
    browser.screenshot(SCREENSHOTS / "index.png")
    chapter = site / "chapters" / "05_tilelang_fast_path" / "index.html"
    if chapter.is_file():
        browser.visit(server + page_url(site, chapter))
        browser.screenshot(SCREENSHOTS / "chapter-05_tilelang_fast_path.png")
    try:
        for width in WIDTHS:
            browser.resize(width)
            for page in sorted((site / "notebooks").glob("*/index.html")):
                browser.visit(server + page_url(site, page), settle=0.3)
                browser.evaluate("window.scrollTo(0, 900)")
                browser.screenshot(SCREENSHOTS / f"notebook-{page.parent.name}-{width}.png")
    finally:
        browser.resize(1280)
    assert (SCREENSHOTS / "index.png").stat().st_size > 10_000
