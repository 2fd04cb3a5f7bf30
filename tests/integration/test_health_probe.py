"""`kvdir health`, the container health check: its verdicts against a real HTTP server on 127.0.0.1, and
that it stays light (Docker runs it in every container every 5 s with a 3 s timeout)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvdir.health import probe


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = {"/health": 200, "/readyz": 503}.get(self.path, 404)
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_verdicts(server: str) -> None:
    assert probe(f"{server}/health", 2.0) is None
    assert probe(f"{server}/readyz", 2.0) == f"HTTP 503 from {server}/readyz"
    assert probe(f"{server}/nope", 2.0) == f"HTTP 404 from {server}/nope"
    refused = probe("http://127.0.0.1:1/health", 2.0)
    assert refused is not None and "refused" in refused.lower()


def test_the_command_exits_by_verdict_and_imports_only_the_standard_library(server: str) -> None:
    """Through kvdir.cli's main, as the console script runs it: pydantic, httpx and FastAPI cost ~1 s of CPU
    per probe to import, which pushed probes past their timeout on a loaded CI host."""
    code = (
        "import sys; from kvdir.cli import main; rc = main(['health', '--url', sys.argv[1]]); "
        "heavy = sorted(m for m in ('pydantic', 'httpx', 'fastapi', 'yaml', 'numpy') if m in sys.modules); "
        "print(rc, heavy)"
    )
    ok = subprocess.run([sys.executable, "-c", code, f"{server}/health"], capture_output=True, text=True, timeout=30)
    assert ok.stdout.strip() == "0 []", ok.stderr
    bad = subprocess.run([sys.executable, "-c", code, f"{server}/readyz"], capture_output=True, text=True, timeout=30)
    assert bad.stdout.strip() == "1 []", bad.stderr
    assert "unhealthy: HTTP 503" in bad.stderr
