"""The chat page at / in headless Chromium (Debian's `chromium` and `chromium-driver`) against a real
`specserve serve` with `auto` speculation and an API key: streamed text, tokens marked by how they were
produced, stop (the server frees the request), the key asked for and a wrong one refused, settings reaching
the request (speculation off, a JSON schema), and model text never becoming HTML.

Set SPECSERVE_SCREENSHOT=docs/chat_page.png to save the page during a speculative generation (the README's
picture); normal runs write nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import httpx
import pytest

from tests.server.helpers import ServerProcess, metric, scrape, wait_for_metric

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install '.[test]')")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if os.environ.get("SPECSERVE_REQUIRE_BROWSER") and not (CHROMIUM and CHROMEDRIVER):  # CI: never a quiet skip
    raise RuntimeError(f"SPECSERVE_REQUIRE_BROWSER is set but chromium={CHROMIUM}, chromedriver={CHROMEDRIVER}")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="headless Chromium is not installed: apt-get install chromium chromium-driver "
           f"(found chromium={CHROMIUM}, chromedriver={CHROMEDRIVER})")

KEY = "page-test-key"
# auto drafting every step: the marks need drafted tokens, whether or not the policy would find them worth
# their price on this host
SPEC = {"method": "auto", "adaptive_draft_length": False}
# Greedy: auto's drafters (suffix and n-gram on the default model's 4-bit blocks) get drafts of its answer accepted.
PROMPT = "Write a Python function that checks whether a number is prime, with a short explanation."
COUNT = "Count from 1 to 1000, separated by commas."
MAX_TOKENS = 160
SHOT_AFTER_ACCEPTED = 50  # into the answer's code block
WAIT_S = 60


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", "2048", "--speculative-config", json.dumps(SPEC), "--api-key", KEY)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(CHROMEDRIVER))
    yield driver
    driver.quit()


def wait(browser, condition, timeout: float = WAIT_S):
    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(condition)


def find(browser, css: str):
    return browser.find_element(By.CSS_SELECTOR, css)


def open_page(browser, server, key: str | None):
    """The page loaded fresh, with `key` in the tab's storage (None: no key)."""
    browser.get(server.url + "/")
    browser.execute_script("sessionStorage.clear(); localStorage.clear();"
                           + (f"sessionStorage.setItem('specserve-api-key', {json.dumps(key)});" if key else ""))
    browser.refresh()
    wait(browser, lambda b: find(b, "#connection").text in ("ready", "API key required"))


def set_field(browser, field_id: str, value) -> None:
    el = find(browser, "#" + field_id)
    el.clear()
    el.send_keys(str(value))


def send(browser, prompt: str) -> None:
    box = find(browser, "#prompt")
    box.send_keys(prompt)
    box.send_keys(Keys.ENTER)


def last_reply(browser) -> dict:
    """The last assistant message, read at once (the page re-renders it as tokens stream in): its classes,
    shown text, token count line and number of accepted-draft spans."""
    return browser.execute_script("""
        const m = [...document.querySelectorAll('.message.assistant')].pop();
        return m && {cls: m.className, text: m.querySelector('.content').textContent, meta: m.querySelector('.meta')
                     .textContent, accepted: m.querySelectorAll('.tok-accepted').length, all: m.textContent};""")


@pytest.fixture
def page(browser, server):
    open_page(browser, server, KEY)
    assert find(browser, "#connection").text == "ready"
    set_field(browser, "temperature", 0)
    return browser


def test_the_page_asks_for_the_key_and_refuses_a_wrong_one(browser, server):
    open_page(browser, server, None)
    dialog = find(browser, "#key-dialog")
    wait(browser, lambda b: dialog.get_attribute("open") is not None)
    assert find(browser, "#connection").text == "API key required"
    find(browser, "#key-cancel").click()

    send(browser, "Hello")  # without a key: the server answers 401, the page shows it and asks again
    wait(browser, lambda b: "failed" in last_reply(b)["cls"])
    assert "401" in last_reply(browser)["all"]
    wait(browser, lambda b: dialog.get_attribute("open") is not None)

    find(browser, "#key-input").send_keys("wrong-key", Keys.ENTER)
    wait(browser, lambda b: "401: the server refused this key" in find(b, "#key-error").text
         and dialog.get_attribute("open") is not None)

    find(browser, "#key-input").send_keys(KEY, Keys.ENTER)
    wait(browser, lambda b: find(b, "#connection").text == "ready")
    assert dialog.get_attribute("open") is None
    assert "SmolLM2" in find(browser, "#model-name").text


def test_streams_a_reply_with_speculated_tokens_marked(page, server):
    set_field(page, "max-tokens", MAX_TOKENS)
    send(page, PROMPT)
    shot = os.environ.get("SPECSERVE_SCREENSHOT")
    seen_streaming_text = taken = False
    deadline = time.monotonic() + WAIT_S
    while "streaming" in (reply := last_reply(page))["cls"]:
        assert time.monotonic() < deadline, "the reply did not finish"
        if reply["text"].strip():
            seen_streaming_text = True
            if shot and not taken and reply["accepted"] >= SHOT_AFTER_ACCEPTED:
                os.makedirs(os.path.dirname(os.path.abspath(shot)), exist_ok=True)
                page.execute_script("document.querySelector('aside').scrollTop = 0")  # the figures, not the settings
                page.save_screenshot(shot)
                taken = True
        time.sleep(0.02)
    assert "done" in reply["cls"]
    assert seen_streaming_text, "no text appeared before the reply finished"
    assert not shot or taken, "the reply finished before a screenshot with accepted drafts could be taken"

    # read in one script: the page may re-render the reply's spans between two WebDriver calls
    drafters = page.execute_script(
        "return [...document.querySelectorAll('.message.assistant .tok-accepted')].map(e => e.dataset.drafter)")
    assert drafters and all(drafters)
    assert int(find(page, "#count-accepted").text) > 0
    assert float(find(page, "#reply-mal").text) > 1.0
    assert find(page, "#reply-tps").text.endswith("tok/s")
    wait(page, lambda b: find(b, "#srv-mal").text not in ("–", ""))  # the /metrics panel saw the drafts

    # the reference: the same conversation through the API (greedy speculation keeps plain decoding's tokens),
    # rendered by the same Markdown renderer
    answer = httpx.post(server.url + "/v1/chat/completions", timeout=WAIT_S, headers={
        "Authorization": f"Bearer {KEY}"}, json={
        "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_completion_tokens": MAX_TOKENS}
    ).json()
    reply = last_reply(page)
    assert reply["meta"].startswith(f"{answer['usage']['completion_tokens']} tokens")
    assert reply["text"] == render_text(page, answer["choices"][0]["message"]["content"])


def test_stop_ends_the_generation_and_the_server_frees_it(page, server):
    set_field(page, "max-tokens", 1000)
    send(page, COUNT)
    wait(page, lambda b: "streaming" in (r := last_reply(b))["cls"] and r["text"].strip())
    assert metric(scrape(server.url), "specserve:num_requests_running") == 1
    find(page, "#stop").click()
    wait(page, lambda b: "stopped" in last_reply(b)["cls"])
    wait_for_metric(server.url, "specserve:num_requests_running", lambda v: v == 0, timeout=10)
    assert metric(scrape(server.url), "specserve:request_success_total", finished_reason="abort") >= 1
    tokens = int(last_reply(page)["meta"].split()[0])
    assert 0 < tokens < 1000
    assert not find(page, "#send").get_attribute("disabled")


def test_settings_turn_speculation_off_and_constrain_the_output(page):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    find(page, "#speculation").click()  # off: num_speculative_tokens 0
    Select(find(page, "#format")).select_by_value("json_schema")
    set_field(page, "schema", json.dumps(schema))
    set_field(page, "max-tokens", 40)
    send(page, "What is 2 + 2? Reply in JSON.")
    wait(page, lambda b: "done" in last_reply(b)["cls"])
    assert isinstance(json.loads(last_reply(page)["text"])["answer"], int)
    assert find(page, "#count-accepted").text == "0" and int(find(page, "#count-target").text) > 0


def render(page, text: str) -> dict:
    """markdown.js on `text`, in the page: the result's HTML, text and element names."""
    return page.execute_async_script("""
        const [text, done] = arguments;
        import('./static/markdown.js').then(({render}) => {
          const box = document.createElement('div');
          render(text, box);
          done({html: box.innerHTML, text: box.textContent, tags: [...box.querySelectorAll('*')].map(e => e.tagName),
                pwned: window.pwned === 1});
        });""", text)


def render_text(page, text: str) -> str:
    return render(page, text)["text"]


def test_model_text_never_becomes_html(page):
    """markdown.js builds DOM nodes from text: tags in model output stay text, Markdown becomes elements."""
    text = ('<img src=x onerror="window.pwned=1"> **bold** and `<b>code</b>`\n\n'
            '```html\n<script>window.pwned=1</script>\n```\n- <i>item</i>\n')
    result = render(page, text)
    assert sorted(set(result["tags"])) == ["CODE", "LI", "P", "PRE", "STRONG", "UL"]
    assert not result["pwned"]
    assert "<img" in result["text"] and "<script>" in result["text"] and "<i>item</i>" in result["text"]
    assert "&lt;img" in result["html"]
