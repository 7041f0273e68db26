"""The chat page (`GET /`) in headless Chromium (Debian's `chromium`, driven by Playwright for
Python) against a real `ferrolm serve` on SmolLM2: it loads with no console errors, answers in a
streamed reply, keeps the conversation, stops a generation (the reply stops growing and the
server's running-requests gauge returns to 0), shows reasoning apart from the answer, and renders
Markdown without ever turning model text into HTML. A screenshot is kept in
tests/server/artifacts/. scripts/test.sh installs chromium and playwright; without them these
tests skip with a notice."""
import json
import os
import time
from pathlib import Path

import pytest

from conftest import ROOT

CHROMIUM = os.environ.get("FERROLM_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]
ARTIFACTS = ROOT / "tests" / "server" / "artifacts"

# Records the answer's text length at every change of the last assistant turn, so a test can
# see that it arrived in pieces (page.evaluate runs outside the page's CSP).
WATCH = """() => {
  window.__lengths = [];
  new MutationObserver(() => {
    const answers = document.querySelectorAll('.assistant .answer');
    const last = answers[answers.length - 1];
    if (last) window.__lengths.push(last.textContent.length);
  }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (scripts/test.sh installs it)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found: apt-get install -y chromium (scripts/test.sh does)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


class Page:
    """A fresh tab on the server's page, with its console errors collected."""

    def __init__(self, browser, url):
        self.tab = browser.new_page(viewport={"width": 1000, "height": 760})
        self.errors = []
        self.tab.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.tab.on("pageerror", lambda e: self.errors.append(str(e)))
        self.response = self.tab.goto(url + "/")

    def ask(self, text):
        self.tab.fill("#input", text)
        self.tab.keyboard.press("Enter")

    def wait_answered(self, n, timeout=90_000):
        """Waits until the n-th assistant turn (1-based) shows its stats line."""
        self.tab.locator(".assistant .meta:not(:empty)").nth(n - 1).wait_for(timeout=timeout)

    def answer(self, n):
        return self.tab.locator(".assistant .answer").nth(n - 1).inner_text()


@pytest.fixture
def page(browser, server):
    p = Page(browser, server.url)
    yield p
    p.tab.close()


def test_page_loads_without_console_errors(page, server):
    assert page.response.status == 200
    headers = page.response.headers
    assert headers["content-type"].startswith("text/html")
    assert "script-src 'sha256-" in headers["content-security-policy"]
    assert page.tab.title() == "ferrolm chat"
    page.tab.locator("#model").filter(has_text="SmolLM2").wait_for(timeout=10_000)
    assert page.tab.locator("#send").is_visible() and not page.tab.locator("#stop").is_visible()
    assert page.errors == []


def test_a_question_is_answered_in_a_streamed_reply_and_the_conversation_kept(page):
    bodies = []
    page.tab.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(json.loads(r.post_data)))
    page.tab.evaluate(WATCH)
    page.ask("Write a Python function that adds two numbers, with a short explanation.")
    page.wait_answered(1)
    lengths = page.tab.evaluate("window.__lengths")
    final = len(page.tab.locator(".assistant .answer").nth(0).text_content())
    partial = {n for n in lengths if 0 < n < final}
    assert len(partial) >= 2, f"the answer did not arrive in pieces: {lengths}"
    assert page.tab.locator(".assistant pre code").count() >= 1, "the code block is rendered as code"
    assert "tok/s" in page.tab.locator(".assistant .meta").nth(0).inner_text()

    page.ask("What is the capital of France?")
    page.wait_answered(2)
    assert "Paris" in page.answer(2)
    assert bodies[0]["stream"] is True and len(bodies[0]["messages"]) == 1
    roles = [m["role"] for m in bodies[1]["messages"]]
    assert roles == ["user", "assistant", "user"], roles
    assert bodies[1]["messages"][1]["content"].strip() != ""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.tab.screenshot(path=str(ARTIFACTS / "chat_page.png"), full_page=True)
    assert page.errors == []


def test_stop_ends_the_generation_in_the_page_and_on_the_server(page, server):
    cancelled = server.metrics().get("ferrolm_requests_cancelled_total", 0)
    page.ask("Tell me a very long story about a dragon who learns to cook, with many chapters.")
    answer = page.tab.locator(".assistant .answer").nth(0)
    deadline = time.monotonic() + 60
    while len(answer.text_content()) < 40:
        assert time.monotonic() < deadline, "no answer arrived"
        time.sleep(0.05)
    page.tab.click("#stop")
    page.wait_answered(1)
    stopped_at = len(answer.text_content())
    assert "stopped" in page.tab.locator(".assistant .meta").nth(0).inner_text()
    time.sleep(1.0)
    assert len(answer.text_content()) == stopped_at, "the reply kept growing after Stop"
    assert page.tab.locator("#send").is_visible()
    deadline = time.monotonic() + 10
    while (m := server.metrics())["ferrolm_requests_running"] != 0:
        assert time.monotonic() < deadline, f"still running: {m['ferrolm_requests_running']}"
        time.sleep(0.1)
    assert m.get("ferrolm_requests_cancelled_total", 0) > cancelled
    assert page.errors == []


# A canned stream: reasoning first, then an answer whose Markdown carries HTML and a script URL.
ANSWER = ("## Result\n\nHere is **bold**, *italic*, `x < y` and a [link](https://example.com) "
          "and [bad](javascript:alert(1)).\n\n- one\n- two <img src=x onerror=\"window.__pwned=1\">\n"
          "  - nested\n\n1. first\n2. second\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
          "```html\n<script>window.__pwned=1</script>\n```\n<b>not bold</b>")


def sse(deltas):
    chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_reasoning_apart_and_markdown_never_html(page):
    deltas = [{"role": "assistant", "content": ""}, {"reasoning_content": "Let me think"},
              {"reasoning": " about it."}] + [{"content": ANSWER[i:i + 7]} for i in range(0, len(ANSWER), 7)]
    page.tab.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=sse(deltas)))
    page.ask("Show me some Markdown")
    page.wait_answered(1)
    tab = page.tab
    # Reasoning sits in its own box, folded once the answer began; a click opens it.
    details = tab.locator(".assistant .reasoning")
    assert details.is_visible() and details.get_attribute("open") is None
    details.locator("summary").click()
    assert details.locator(".reasoning-text").inner_text() == "Let me think about it."
    answer = tab.locator(".assistant .answer")
    assert "Let me think" not in answer.inner_text()
    assert answer.locator("h2").inner_text() == "Result"
    assert answer.locator("strong").first.inner_text() == "bold" and answer.locator("em").count() == 1
    assert answer.locator("p code").first.inner_text() == "x < y"
    assert answer.locator("a").count() == 1 and answer.locator("a").get_attribute("href") == "https://example.com"
    assert "[bad](javascript:alert(1))" in answer.inner_text()
    assert answer.locator(":scope > ul > li").count() == 2 and answer.locator("ul ul > li").inner_text() == "nested"
    assert answer.locator("ol > li").count() == 2 and answer.locator("td").count() == 2
    assert answer.locator("pre code").inner_text() == "<script>window.__pwned=1</script>"
    # Model text is text: no element came from it, nothing ran.
    assert answer.locator("img, script, b").count() == 0
    assert "<b>not bold</b>" in answer.inner_text() and "<img src=x" in answer.inner_text()
    assert tab.evaluate("window.__pwned") is None
    assert tab.locator(".assistant .meta").inner_text().startswith("5 tokens")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / "chat_page_markdown.png"), full_page=True)
    assert page.errors == []


def test_an_error_is_shown_and_the_turn_dropped(page):
    error = {"error": {"message": "The served model 'x' cannot generate", "type": "invalid_request_error",
                       "param": "model", "code": "model_not_supported"}}
    page.tab.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=400, headers={"content-type": "application/json"}, body=json.dumps(error)))
    page.ask("hello")
    page.wait_answered(1)
    meta = page.tab.locator(".assistant .meta")
    assert meta.inner_text() == "Error: The served model 'x' cannot generate"
    assert "error" in meta.get_attribute("class")
    assert page.tab.locator("#send").is_visible()

