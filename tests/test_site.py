"""The built documentation site works where the README says to open it: `site/index.html` from
the file system (file://), and over HTTP.

From file:// a browser opens what a link names: a link to `training/` opens a directory listing,
not the page (mkdocs' `use_directory_urls`), and the search cannot fetch its index (browsers refuse
fetch() on file:// URLs; mkdocs-material's `offline` plugin ships the index as a script instead).
The site is built here into a temporary directory, and every internal link and asset of every
built page (the navigation included) must resolve to a file; the same links are then fetched
over HTTP from a server on 127.0.0.1. (Checked by hand in headless Chromium as well, from
file://: the navigation opens pages and the search finds words; see the issue 26 report.)
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs tools are the [docs] extra (make test installs them)")

ROOT = Path(__file__).resolve().parent.parent


class _Links(HTMLParser):
    """The href of every <a> and <link>, the src of every <script>, <img> and <iframe>; nav links
    (the `md-nav__link` class) apart."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []
        self.nav: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        url = a.get("href") if tag in ("a", "link") else a.get("src") if tag in ("script", "img", "iframe") else None
        if url is None:
            return
        self.urls.append(url)
        if tag == "a" and "md-nav__link" in (a.get("class") or "").split():
            self.nav.append(url)


def _internal(url: str) -> str | None:
    """The path part of a link inside the site; None for other sites, mail, or a fragment alone."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme or parts.netloc or not parts.path:
        return None
    return urllib.parse.unquote(parts.path)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
                       cwd=ROOT, capture_output=True, text=True, check=False,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


def _pages(site: Path) -> list[Path]:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 20, pages
    return pages


def _links(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text())
    return parser


def test_every_link_of_every_page_opens_a_file_from_the_file_system(site):
    broken, nav_seen = [], 0
    for page in _pages(site):
        if page.name == "404.html" and page.parent == site:
            continue  # served by a web server for a missing page only, with links from the site's root
        links = _links(page)
        nav_seen += len(links.nav)
        for url in links.urls:
            path = _internal(url)
            if path is None:
                continue
            target = (page.parent / path).resolve()
            if not target.is_file():
                what = "a directory (file:// shows a listing)" if target.is_dir() else "missing"
                broken.append(f"{page.relative_to(site)}: {url} -> {what}")
    assert nav_seen > 100, "no navigation links found: did the theme's markup change?"
    assert not broken, f"{len(broken)} links do not open a file, e.g.:\n" + "\n".join(broken[:20])


def test_search_works_without_a_server(site):
    """From file:// the search index must come as a script (fetch() of a file:// URL is refused):
    the offline plugin writes search/search_index.js, which the search worker loads, and the
    worker runs in an iframe through the iframe-worker shim, loaded from the site itself (a CDN
    copy would leave search dead without the network)."""
    index = site / "search" / "search_index.js"
    assert index.is_file(), "no search/search_index.js: search is dead on file://"
    text = index.read_text()
    assert text.startswith("var __index = ") and "CheckpointManager" in text and "release_host_memory" in text
    # Words inside code are found: `optax.tree_map_params(...)` is split into `optax` and
    # `tree_map_params` by the index's separator (the theme's JavaScript uses it as a RegExp).
    separator = json.loads(text.removeprefix("var __index = "))["config"]["separator"]
    assert re.split(separator, "x = optax.tree_map_params(tx)") == ["x", "optax", "tree_map_params", "tx", ""]
    bundle = "\n".join(p.read_text() for p in (site / "assets" / "javascripts").glob("bundle.*.js"))
    assert "search_index.js" in bundle, "the theme's search no longer loads search_index.js"
    for page in _pages(site):
        scripts = _links(page).urls
        assert any(u.endswith("javascripts/iframe-worker-shim.js") and _internal(u) for u in scripts), \
            f"{page.relative_to(site)} does not load the iframe-worker shim from the site"


def test_no_page_needs_the_network(site):
    """Scripts, stylesheets and fonts come from the site: opened offline it looks and works the same."""
    external = set()
    for page in _pages(site):
        text = page.read_text()
        for m in re.finditer(r'<(script|link)\b[^>]*\b(?:src|href)="(https?:)?//([^"/]+)[^"]*"', text):
            tag = m.group(0)
            if m.group(1) == "link" and 'rel="stylesheet"' not in tag and 'rel="preconnect"' not in tag:
                continue
            external.add(f"{page.relative_to(site)}: {tag}")
    assert not external, "\n".join(sorted(external)[:10])


def test_every_link_is_served_over_http(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        urls = set()
        for page in _pages(site):
            page_url = urllib.parse.urljoin(base, page.relative_to(site).as_posix())
            urls |= {urllib.parse.urljoin(page_url, u).split("#")[0] for u in _links(page).urls if _internal(u)}
        bad = []
        for url in sorted(urls):
            with urllib.request.urlopen(url, timeout=10) as r:
                body = r.read()
                if r.status != 200 or not body:
                    bad.append(f"{url}: HTTP {r.status}, {len(body)} bytes")
        assert len(urls) > 20 and not bad, bad
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the test reports failures itself
        pass
