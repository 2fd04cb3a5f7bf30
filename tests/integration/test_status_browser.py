"""The gateway's status page in a real browser engine (issue #34, item 3): Debian's Chromium, headless, loads `/`
of a live gateway (a 1-replica directory, 2 worker stubs) and the rendered DOM must hold the figures; with the
directory stopped the page must still render and say the directory is unreachable.

Marked `browser`: `make test-browser` runs it (after `make browser-deps` installs Chromium), `make test` does not.
With KVDIR_UPDATE_SCREENSHOT=1 it drives longer traffic, so the charts have something to show, and writes the
screenshot README.md shows (docs/img/status-page.png).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from kvproto.tokenizer import render_chat
from tests.support.wait import wait_for

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "status-page.png"
UPDATE = os.environ.get("KVDIR_UPDATE_SCREENSHOT") == "1"
MODEL = "kvdir-stub"
CHATS = (
    "Bicycle shop support: answer questions about repairs, parts and opening hours. " * 4,
    "Rail travel planner: suggest train connections across Europe with changes and fares. " * 4,
    "Kitchen helper: propose a recipe from whatever the user says is in the fridge. " * 4,
)


class _Dom(HTMLParser):
    """The text of every element with an `id`, `data-engine` or `data-reason` attribute, from a DOM dump."""

    VOID = frozenset({"meta", "link", "br", "img", "input", "hr", "wbr"})  # HTML's elements without an end tag

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.texts: dict[str, str] = {}
        self._open: list[tuple[str, str | None]] = []
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.VOID:
            return
        a = dict(attrs)
        key = a.get("id") or (f"engine:{a['data-engine']}" if a.get("data-engine") else None)
        key = key or (f"reason:{a['data-reason']}" if a.get("data-reason") else None)
        if key is not None:
            self.texts[key] = ""
        self._open.append((tag, key))

    def handle_endtag(self, tag: str) -> None:
        if any(t == tag for t, _ in self._open):
            while self._open.pop()[0] != tag:
                pass

    def handle_data(self, data: str) -> None:
        for _, key in self._open:
            if key is not None:
                self.texts[key] += data


def _chromium(url: str, profile: Path, *args: str) -> str:
    """Run headless Chromium on `url` with `args`; its stdout. Its whole process group is killed however it ends."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make browser-deps` (installs Debian's chromium, as root) for this test")
    cmd = [str(CHROMIUM), "--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}"]
    cmd += ["--no-first-run", "--disable-extensions", "--hide-scrollbars", *args, url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        with contextlib.suppress(ProcessLookupError):  # its renderer and zygote processes too
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {err.decode(errors='replace')[-2000:]}"
    return out.decode()


def _load(url: str, tmp_path: Path) -> tuple[dict[str, str], float]:
    """The page's DOM as Chromium rendered it (texts by id), and how long Chromium took."""
    profile = tmp_path / f"chromium-{time.monotonic_ns()}"
    profile.mkdir()
    t = time.perf_counter()
    dom = _chromium(url, profile, "--dump-dom")
    took = time.perf_counter() - t
    assert "<h1>kvdir gateway</h1>" in dom, dom[:2000]
    return _Dom(dom).texts, took


def _screenshot(url: str, tmp_path: Path) -> Path:
    profile = tmp_path / "chromium-shot"
    profile.mkdir()
    path = tmp_path / "status-page.png"
    _chromium(url, profile, f"--screenshot={path}", "--window-size=1280,1600")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000, path
    return path


def _published(http: httpx.Client, replica: str, messages: list[dict[str, str]]) -> bool:
    """Whether the directory lists a holder of all of the prompt just served (`messages` but the answer)."""
    tokens = list(render_chat(messages[:-1]).encode())  # the stubs' template and byte tokenizer, as the gateway's
    found = http.post(replica + "/v1/lookup", json={"tokens": tokens, "model": MODEL}).json()
    return any(h["matched_blocks"] == found["num_blocks"] for h in found["holders"])


def _drive(gateway: str, replica: str, chats: int, rounds: int, pause_s: float) -> collections.Counter[str]:
    """Chats through the gateway, one turn of each per round, each round once the last one's prompts are published
    (a user's think time): the decisions the gateway took, counted."""
    convs = [[{"role": "system", "content": system}] for system in CHATS[:chats]]
    decisions: collections.Counter[str] = collections.Counter()
    with httpx.Client(timeout=60) as http:
        for turn in range(rounds):
            for i, messages in enumerate(convs):
                messages.append({"role": "user", "content": f"Question {turn + 1} of chat {i}: what is cached now?"})
                r = http.post(gateway + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8})
                r.raise_for_status()
                decisions[r.headers["x-kvdir-decision"]] += 1
                messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            wait_for(lambda: all(_published(http, replica, m) for m in convs), what="the chats' prompts published")
            time.sleep(pause_s)
    return decisions


def test_the_status_page_renders_the_figures_in_chromium_and_survives_the_directory(
    make_cluster, make_workers, make_gateway, tmp_path: Path
) -> None:
    c = make_cluster(1)
    w = make_workers(c, 2, ("--transfer", "tcp"))
    g = make_gateway(c, 2)
    t = time.perf_counter()
    decisions = _drive(g.url, c.replica_urls[0], 3, 12, 2.0) if UPDATE else _drive(g.url, c.replica_urls[0], 2, 3, 0.0)
    sent = sum(decisions.values())
    print(f"{sent} requests in {time.perf_counter() - t:.1f} s, decisions {dict(decisions)}")
    assert decisions["balance"] and decisions["affinity"] + decisions["pull"], decisions

    page, took = _load(g.url + "/", tmp_path)
    print(f"page loaded in Chromium in {took:.2f} s")
    assert page["requests-total"] == str(sent)
    for node in w.node_ids:
        assert node in page[f"engine:{node}"]
    for reason, n in decisions.items():
        assert re.search(rf"\b{reason} {n}\b", page[f"reason:{reason}"]), page[f"reason:{reason}"]
    assert page["leader"] == "replica 1 of 1"
    assert page["directory-state"] == "reachable" and "directory-alert" not in page
    assert int(page["term"]) >= 1
    assert "mirror" in page["lookups"]
    shot = _screenshot(g.url + "/", tmp_path)
    if UPDATE:
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)
        print(f"screenshot written to {SCREENSHOT}")
    figures = httpx.get(g.url + "/v1/status")
    assert figures.json()["requests"]["total"] == sent and figures.json()["directory"]["leader"] == 1
    assert "127.0.0.1" not in figures.text  # like the page, no address (the gateway's port is public)

    c.stop()
    wait_for(lambda: not httpx.get(g.url + "/health").json()["directory"], what="the gateway to notice the directory is gone")
    page, took = _load(g.url + "/", tmp_path)
    print(f"page with the directory down loaded in Chromium in {took:.2f} s")
    assert page["directory-state"] == "unreachable" and "unreachable" in page["directory-alert"]
    assert page["leader"] == "unknown"
    assert page["requests-total"] == str(sent)  # the gateway's own figures are still there
    assert all(f"engine:{node}" in page for node in w.node_ids)
    down = httpx.get(g.url + "/v1/status")
    assert down.status_code == 200 and down.json()["directory"]["up"] is False
