"""The chat page and dashboard in a real browser (Debian's Chromium driven by Playwright)
against a real `dolmus serve` of a real chat model (SmolLM2-135M-Instruct, Q4_1 GGUF).

Every browser request is intercepted: anything not for the server on loopback is recorded
and refused, and the tests fail if there was any. Console errors and page errors fail too.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import RemoteServer

playwright_sync = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REPO = Path(__file__).resolve().parents[1]
_GGUF = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_MODEL = next(
    (
        p
        for p in (
            Path(os.environ.get("DOLMUS_SHARED_MODELS", REPO.parent / "shared" / "models")) / _GGUF,
            Path("/work/shared/models") / _GGUF,
        )
        if p.is_file()
    ),
    None,
)
SCREENSHOTS = Path(os.environ["DOLMUS_SCREENSHOTS"]) if os.environ.get("DOLMUS_SCREENSHOTS") else None

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Chromium (apt-get install chromium)"),
    pytest.mark.skipif(CHAT_MODEL is None, reason="needs ../shared/models/smollm2-135m-instruct"),
]


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer(
        "--model", str(CHAT_MODEL), "--served-model-name", "SmolLM2-135M-Instruct", "--max-model-len", "2048"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright_sync.sync_playwright() as p:
        yield p


class Page:
    """One fresh browser profile on the page, with every outside request refused and recorded."""

    def __init__(self, p: object, url: str, profile: Path) -> None:
        self.url = url
        self.context = p.chromium.launch_persistent_context(  # type: ignore[attr-defined]
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 860},
        )
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.pages[0] if self.context.pages else self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url + "/")

    def _route(self, route: object) -> None:
        request_url = route.request.url  # type: ignore[attr-defined]
        if request_url.startswith(self.url + "/"):
            route.continue_()  # type: ignore[attr-defined]
        else:
            self.outside.append(request_url)
            route.abort()  # type: ignore[attr-defined]

    def close(self) -> None:
        self.context.close()
        assert self.outside == [], f"requests left loopback: {self.outside}"
        assert self.errors == [], f"console errors: {self.errors}"


@pytest.fixture
def page(browser: object, server: RemoteServer, tmp_path: Path) -> Iterator[Page]:
    p = Page(browser, server.url, tmp_path / "profile")
    yield p
    p.close()


def _wait_model(page: object) -> None:
    """The model picker filled from /v1/models (the page's CSP rules out evaluated waits)."""
    page.locator("#model option").first.wait_for(state="attached")  # type: ignore[attr-defined]


def _ask(page: object, text: str) -> None:
    page.fill("#input", text)  # type: ignore[attr-defined]
    page.press("#input", "Enter")  # type: ignore[attr-defined]


def _last_answer(page: object) -> object:
    return page.locator(".msg.assistant").last  # type: ignore[attr-defined]


def _set(page: object, field: str, value: str) -> None:
    page.eval_on_selector("#settings", "d => { d.open = true; }")  # type: ignore[attr-defined]
    page.fill(f"#set-{field}", value)  # type: ignore[attr-defined]
    page.dispatch_event(f"#set-{field}", "change")  # type: ignore[attr-defined]


def _finished(server: RemoteServer) -> float:
    m = server.metrics()
    names = [f'dolmus:request_success_total{{finished_reason="{r}"}}' for r in ("stop", "length")]
    return sum(m.get(name, 0.0) for name in names)


def _metric(server: RemoteServer, name: str) -> float:
    return server.metrics().get(name, 0.0)


def _wait_for(page: object, check, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Poll `check` while the browser runs on: the sync API serves the intercepting route only
    inside Playwright calls, so a plain sleep here would stall the page's requests."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        page.wait_for_timeout(200)  # type: ignore[attr-defined]


def test_page_is_served_with_a_strict_policy(server: RemoteServer) -> None:
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and "<title>dolmus</title>" in r.text
    assert r.headers["content-security-policy"].startswith("default-src 'self'")
    assert httpx.get(server.url + "/ui/vendor/VENDOR.json").status_code == 200
    assert httpx.get(server.url + "/ui/no-such-file.js").status_code == 404


def test_chat_streams_renders_and_survives_a_reload(page: Page, server: RemoteServer) -> None:
    pg = page.page
    _wait_model(pg)
    assert pg.input_value("#model") == server_model(server)
    _set(pg, "temperature", "0")
    _set(pg, "max_tokens", "60")
    _ask(pg, "Write a Python function that adds two numbers, in a code block.")
    answer = _last_answer(pg)
    answer.locator(".stats").wait_for(timeout=60_000)  # the final chunk's timings arrived
    stats = answer.locator(".stats").inner_text()
    assert "TTFT" in stats and "tok/s" in stats and "from cache" in stats
    text = answer.locator(".body").inner_text()
    assert text.strip()
    if "```" not in text and answer.locator("pre code").count():  # rendered markdown, highlighted
        assert "hljs" in (answer.locator("pre code").first.get_attribute("class") or "")
    if SCREENSHOTS is not None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(SCREENSHOTS / "chat.png"))

    # regenerate replaces the answer with a new request's
    finished = _finished(server)
    pg.click(".msg.assistant .regenerate")
    _wait_for(pg, lambda: _finished(server) > finished, timeout=60)
    _last_answer(pg).locator(".stats").wait_for(timeout=60_000)
    assert pg.locator(".msg").count() == 2
    text = _last_answer(pg).locator(".body").inner_text()
    assert text.strip()

    # the conversation is in IndexedDB: a reload finds it, titled by the first message
    pg.reload()
    pg.locator("#conversations li").first.wait_for()
    assert pg.locator("#conversations li").first.inner_text().startswith("Write a Python function")
    pg.locator(".msg.assistant .body").first.wait_for()
    assert pg.locator(".msg.assistant .body").first.inner_text() == text

    # edit and resend: the conversation is cut at the edited message
    pg.click(".msg.user .edit")
    pg.fill(".edit-area", "Say hello.")
    pg.click("text=Save and send")
    _last_answer(pg).locator(".stats").wait_for(timeout=60_000)
    assert pg.locator(".msg").count() == 2
    assert pg.locator(".msg.user .body").inner_text() == "Say hello."


def server_model(server: RemoteServer) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def test_stop_aborts_the_request_in_the_engine(page: Page, server: RemoteServer) -> None:
    pg = page.page
    _wait_model(pg)
    _set(pg, "max_tokens", "1500")
    _set(pg, "temperature", "0.8")
    aborted = _metric(server, 'dolmus:request_success_total{finished_reason="abort"}')
    _ask(pg, "Tell me a very long story about a bus in Istanbul.")
    _wait_for(pg, lambda: len(_last_answer(pg).locator(".body").inner_text()) > 20, timeout=60)
    pg.click("#stop")
    _last_answer(pg).locator(".stopped").wait_for()
    assert pg.is_visible("#send")
    _wait_for(pg, lambda: _metric(server, 'dolmus:request_success_total{finished_reason="abort"}') > aborted)
    # nothing left running in the engine
    _wait_for(pg, lambda: _metric(server, "dolmus:num_requests_running") == 0)


def test_dashboard_agrees_with_metrics(page: Page, server: RemoteServer) -> None:
    pg = page.page
    _wait_model(pg)
    _set(pg, "max_tokens", "16")
    _ask(pg, "Hi!")
    _last_answer(pg).locator(".stats").wait_for(timeout=60_000)
    pg.click("#tab-dashboard")
    _wait_for(pg, lambda: _metric(server, "dolmus:num_requests_running") == 0)
    metrics = server.metrics()
    want = {
        "generation_tokens": metrics["dolmus:generation_tokens_total"],
        "prompt_tokens": metrics["dolmus:prompt_tokens_total"],
        "preemptions": metrics["dolmus:num_preemptions_total"],
    }

    def shown() -> dict[str, float]:
        values = {}
        for name in want:
            raw = pg.get_attribute(f"[data-total={name}]", "data-value")
            values[name] = float(raw) if raw not in (None, "", "undefined") else -1.0
        return values

    _wait_for(pg, lambda: shown() == want)  # the next poll (once a second) shows them
    finished = json.loads(pg.get_attribute("[data-total=finished]", "data-value") or "{}")
    assert finished["stop"] + finished["length"] >= 1
    assert finished["abort"] == metrics['dolmus:request_success_total{finished_reason="abort"}']
    pg.locator("#chart-throughput canvas").wait_for()
    assert pg.locator(".charts canvas").count() == 5
    if SCREENSHOTS is not None:
        pg.screenshot(path=str(SCREENSHOTS / "dashboard.png"))


def test_page_asks_for_the_key_when_the_server_needs_one(browser: object, tmp_path: Path) -> None:
    with RemoteServer("--api-key", "sesame") as keyed:
        p = Page(browser, keyed.url, tmp_path / "profile")
        try:
            pg = p.page
            pg.locator("#key-dialog").wait_for()
            pg.fill("#key-input", "sesame")
            pg.click("#key-save")
            _wait_model(pg)
            assert pg.input_value("#model") == "stories260k"
            pg.click("#tab-dashboard")  # the request list (behind the key) loads with it
            pg.locator("#requests-note").filter(has_text="no requests").wait_for()
        finally:
            p.close()


def test_answers_render_safely_with_thinking_folded(page: Page) -> None:
    pg = page.page
    _wait_model(pg)
    html = pg.evaluate(
        """async () => {
            const { renderMarkdown } = await import('/ui/markdown.js');
            const box = document.createElement('div');
            renderMarkdown(box, '<think>step one</think>**bold** <script>window.hit=1</script>'
                + '[link](javascript:window.hit=1)\\n\\n```python\\ndef f():\\n    return 1\\n```');
            const open = document.createElement('div');
            renderMarkdown(open, '<think>still thinking');
            return { html: box.innerHTML, open: open.innerHTML, hit: window.hit === 1 };
        }"""
    )
    assert '<details class="think"><summary>Thought</summary><p>step one</p>' in html["html"]
    assert "<strong>bold</strong>" in html["html"] and not html["hit"]
    assert "<script" not in html["html"] and "javascript:" not in html["html"]
    assert "language-python" in html["html"] and '<span class="hljs-keyword">return</span>' in html["html"]
    assert "<summary>Thinking…</summary>" in html["open"]


def test_reasoning_content_is_shown_folded(browser: object, tmp_path: Path) -> None:
    """With a reasoning parser the server sends the thinking as `reasoning_content`; the page
    folds it like a <think> block. deepseek_r1 reads a reply that never closes its think block
    as all reasoning, which the built-in model's replies are."""
    with RemoteServer("--reasoning-parser", "deepseek_r1") as srv:
        body = {"model": "stories260k", "messages": [{"role": "user", "content": "Hi"}]}
        direct = httpx.post(
            srv.url + "/v1/chat/completions", json={**body, "temperature": 0, "max_tokens": 20}
        ).json()["choices"][0]["message"]
        assert direct["reasoning_content"] and not direct["content"]
        p = Page(browser, srv.url, tmp_path / "profile")
        try:
            pg = p.page
            _wait_model(pg)
            _set(pg, "temperature", "0")
            _set(pg, "max_tokens", "20")
            _ask(pg, "Hi")
            answer = _last_answer(pg)
            answer.locator(".stats").wait_for(timeout=60_000)
            fold = answer.locator("details.think")
            assert fold.count() == 1 and fold.locator("summary").inner_text() == "Thought"
            fold.locator("summary").click()
            assert fold.inner_text().removeprefix("Thought").split() == direct["reasoning_content"].split()
            pg.reload()  # kept with the conversation
            pg.locator(".msg.assistant details.think").first.wait_for()
        finally:
            p.close()


def test_conversations_rename_delete_export_import(page: Page, browser: object, tmp_path: Path) -> None:
    pg = page.page
    _wait_model(pg)
    _set(pg, "max_tokens", "8")
    for text in ("First question", "Second question"):
        pg.click("#new-chat")
        _ask(pg, text)
        _last_answer(pg).locator(".stats").wait_for(timeout=60_000)
    items = pg.locator("#conversations li")
    assert items.count() == 2
    items.filter(has_text="First question").locator("button[title=Rename]").click()
    pg.fill("#conversations .rename", "Renamed")
    pg.press("#conversations .rename", "Enter")
    items.filter(has_text="Renamed").wait_for()
    with pg.expect_download() as download:
        pg.click("#export")
    exported = tmp_path / "export.json"
    download.value.save_as(exported)
    data = json.loads(exported.read_text())
    assert sorted(c["title"] for c in data["conversations"]) == ["Renamed", "Second question"]
    items.filter(has_text="Second question").locator("button[title=Delete]").click()
    pg.locator("#conversations li", has_text="Second question").wait_for(state="detached")
    assert items.count() == 1

    fresh = Page(browser, page.url, tmp_path / "other-profile")  # another browser: nothing stored
    try:
        fresh_page = fresh.page
        _wait_model(fresh_page)
        assert fresh_page.locator("#conversations li").count() == 0
        fresh_page.set_input_files("#import", str(exported))
        fresh_page.locator("#conversations li", has_text="Second question").wait_for()
        assert fresh_page.locator("#conversations li").count() == 2
    finally:
        fresh.close()
