"""The chat page (`GET /`, pipeline/server/page.py) in headless Chromium, against a live tree_ngram
server on the tiny model: a request the server refuses shows its error line and stays out of the
conversation; a repetitive prompt's streamed answer shows exactly the text the API gives for the
same request, in one shaded span per engine step whose token counts add up to the completion
tokens, some steps committing several tokens, and the server's speculation figures. The screenshot
goes to outputs/tests/page.png. Against a server with an API key, the page asks for the key (again,
saying so, when the server refuses it), keeps it for the tab and sends it with every /v1 call."""
from __future__ import annotations

import contextlib
import shutil

import httpx
import pytest


from helpers import REPO_ROOT
from serving import live_server

INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium (make setup does both as root)"
webdriver = pytest.importorskip("selenium.webdriver", reason=f"the page test needs selenium: {INSTALL}")
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip(f"the page test needs Chromium and its driver: {INSTALL}", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402  (only once selenium is known to be there)
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

PROMPT = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3"  # the tiny model repeats itself: n-gram drafts are accepted
MAX_TOKENS = 48
KEY = "test-key-123"
KEY_ITEM = "pipeline.serve.api_key"  # the page's sessionStorage item

@contextlib.contextmanager
def chromium():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1000,760"):
        opts.add_argument(arg)  # no sandbox: the tests run as root
    driver = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def key_asked(driver) -> bool:
    return driver.find_element(By.ID, "key-form").is_displayed()


def enter_key(driver, key: str, refused: bool) -> None:
    """Waits for the page to ask for the API key (saying the last one was refused, or not), enters `key`."""
    WebDriverWait(driver, 10).until(lambda d: key_asked(d) and d.execute_script(
        "return document.getElementById('key-note').classList.contains('refused')") == refused)
    assert ("refused" in driver.find_element(By.ID, "key-note").text) == refused
    driver.find_element(By.ID, "api-key").send_keys(key, Keys.ENTER)


def models(driver) -> list[str]:
    WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
    return [o.text for o in driver.find_elements(By.CSS_SELECTOR, "#model option")]


def ask(driver, prompt: str, max_tokens: str, key: str | None = None) -> dict:
    """Sends `prompt` from the page (Enter), waits for its turn to end; returns what the turn shows.
    key: the server refuses the page's key, so the page asks again: enter this one."""
    turns = len(driver.find_elements(By.CSS_SELECTOR, ".turn"))
    field = driver.find_element(By.ID, "max-tokens")
    field.clear()
    field.send_keys(max_tokens)
    driver.find_element(By.ID, "prompt").send_keys(prompt, Keys.ENTER)
    if key is not None:
        enter_key(driver, key, refused=True)
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(
        "const t = document.querySelectorAll('.turn'); return t.length > arguments[0] && "
        "t[t.length - 1].dataset.state !== 'streaming'", turns))
    return driver.execute_script("""
        const turn = [...document.querySelectorAll('.turn')].pop(), figure = (name) => {
          const b = turn.querySelector(`[data-figure="${name}"]`); return b && b.textContent; };
        return {state: turn.dataset.state, text: turn.querySelector('.answer').textContent,
                steps: [...turn.querySelectorAll('.answer .step')].map((s) => Number(s.dataset.tokens)),
                error: (turn.querySelector('.error') || {}).textContent, server_steps: figure('server-steps')};""")


def check_answer(url: str, shown: dict, headers: dict | None = None) -> None:
    """`shown` (the page's turn for PROMPT, first in its conversation) against the same request, whole."""
    assert shown["state"] == "done", shown
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers=headers, json={
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    want = r.json()
    assert shown["text"] == want["choices"][0]["message"]["content"]
    assert shown["steps"] and sum(shown["steps"]) == want["usage"]["completion_tokens"]
    assert max(shown["steps"]) > 1, shown["steps"]  # speculation committed several tokens in a step
    assert len(shown["steps"]) == want["speculation"]["steps"] == int(shown["server_steps"])


def no_script_error(driver) -> bool:  # (a 401 is logged too, but as "network")
    return [e for e in driver.get_log("browser") if e["source"] == "javascript"] == []


def test_page_streams_an_answer_shaded_by_step(tmp_path):
    with live_server("decode=tree_ngram", "batch_size=2") as (_, url), chromium() as driver:
        driver.get(f"{url}/")
        assert models(driver) == ["tiny"]

        refused = ask(driver, "hello", "0")  # the server's 400, as an error line
        assert refused["state"] == "error" and "max_tokens" in refused["error"], refused

        shown = ask(driver, PROMPT, str(MAX_TOKENS))
        check_answer(url, shown)  # the same request, whole: the refused turn must not have gone into the conversation
        assert not key_asked(driver)  # a server without a key: never asked
        assert no_script_error(driver)

        shot = tmp_path / "page.png"
        assert driver.save_screenshot(str(shot))
        out = REPO_ROOT / "outputs" / "tests" / "page.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, out)
        print(f"page screenshot: {out}")


def test_page_asks_for_the_api_key():
    with live_server("decode=tree_ngram", "batch_size=2", f"api_key={KEY}") as (_, url), chromium() as driver:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        driver.get(f"{url}/")
        enter_key(driver, "wrong-key", refused=False)  # GET /v1/models answered 401: asked
        enter_key(driver, KEY, refused=True)  # the wrong key answered 401 again: asked again, saying so
        assert models(driver) == ["tiny"] and not key_asked(driver)
        assert driver.execute_script(f"return sessionStorage.getItem('{KEY_ITEM}')") == KEY

        driver.refresh()  # the same tab: the key is kept, not asked again
        assert models(driver) == ["tiny"] and not key_asked(driver)
        shown = ask(driver, PROMPT, str(MAX_TOKENS))
        check_answer(url, shown, {"Authorization": f"Bearer {KEY}"})
        assert len(driver.find_elements(By.CSS_SELECTOR, ".turn")) == 1

        # a key the server no longer takes: the chat call's 401 asks again, and the turn goes through
        driver.execute_script(f"sessionStorage.setItem('{KEY_ITEM}', 'stale-key')")
        again = ask(driver, PROMPT, str(MAX_TOKENS), key=KEY)
        assert again["state"] == "done" and again["steps"] and not again["error"], again
        assert len(driver.find_elements(By.CSS_SELECTOR, ".turn")) == 2 and not key_asked(driver)
        assert driver.execute_script(f"return sessionStorage.getItem('{KEY_ITEM}')") == KEY
        assert no_script_error(driver)
