"""The API docs (`/docs`, Swagger UI) of every kvdir server load from that server alone: no CDN, no
other host, so they work in an air-gapped cluster (issue #34); with auth on, behind the directory's token."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import httpx

CONTENT_TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png"}  # the UI's script, its style, the favicon
ADMIN, GATEWAY = "admin-tok-docs-9c1e77", "gateway-tok-docs-41b0aa"


class _References(HTMLParser):
    """Every `src` and `href` of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]


def _on_this_host(url: str) -> bool:
    return url.startswith("/") and not url.startswith("//")


def assert_offline_docs(base: str, headers: dict[str, str] | None = None) -> None:
    """/docs references only paths on `base`, and each of them is served, non-empty, as what it is."""
    r = httpx.get(base + "/docs", headers=headers, timeout=5)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.text
    page = r.text
    for off_host in ("http://", "https://", "//cdn"):
        assert off_host not in page, (base, off_host, page)
    refs = _References()
    refs.feed(page)
    assert sorted(Path(u).suffix for u in refs.urls) == sorted(CONTENT_TYPES), refs.urls
    schema = re.search(r"url: '([^']*)'", page)
    assert schema is not None, page
    for url in [*refs.urls, schema.group(1)]:
        assert _on_this_host(url), (base, url)
    for url in refs.urls:
        asset = httpx.get(base + url, headers=headers, timeout=10)
        assert asset.status_code == 200 and asset.content, (base, url, asset.status_code)
        assert CONTENT_TYPES[Path(url).suffix] in asset.headers["content-type"], (url, asset.headers["content-type"])
        if url.endswith(".css"):  # what the style sheet loads in turn: only inline data
            loads = re.findall(r"url\(\s*['\"]?([^'\")]*)", asset.text)
            assert all(u.startswith("data:") for u in loads), [u for u in loads if not u.startswith("data:")]
    assert httpx.get(base + schema.group(1), headers=headers, timeout=5).json()["openapi"]
    assert httpx.get(base + "/redoc", headers=headers, timeout=5).status_code == 404  # off: it would load from a CDN


def test_docs_of_the_directory_gateway_and_worker_load_from_their_own_host(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    w = make_workers(c, 1)
    g = make_gateway(c, 1)
    for base in (c.replica_urls[0], g.url, w.urls[0]):
        assert_offline_docs(base)


def test_directory_docs_need_a_token_with_auth_on(make_cluster, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"admin:*:{ADMIN}\ngateway:*:{GATEWAY}\n")
    tokens.chmod(0o600)
    c = make_cluster(1, extra_args=("--auth-tokens-file", str(tokens)), token=ADMIN)
    url = c.replica_urls[0]
    for path in ("/docs", "/docs/assets/swagger-ui-bundle.js", "/openapi.json"):
        r = httpx.get(url + path, timeout=5)
        assert r.status_code == 401 and r.json()["error"] == "unauthorized", (path, r.status_code)
    assert_offline_docs(url, {"Authorization": f"Bearer {GATEWAY}"})  # any role may read them
