"""``ppolm label`` in a real browser: Chromium (Debian's ``chromium`` and ``chromium-driver``
packages, which .ci/run installs) driven by Selenium, against the command run as a user runs it.

Two prompts are ranked by keyboard and one by clicking, one judgement is undone, the server is
killed and started again, the rest is finished; the JSONL then holds exactly the judgements made,
and ``ppolm reward`` trains on the pairs. An answer holding HTML and script is shown as text."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ppolm import config, label
from ppolm.cli import main
from ppolm.label import LabelConfig
from ppolm.label_store import LabelStore, expand_pairs

CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
pytestmark = [
    pytest.mark.skipif(not (CHROMIUM.is_file() and DRIVER.is_file()),
                       reason="needs Chromium at /usr/bin/chromium and /usr/bin/chromedriver "
                              "(apt-get install chromium chromium-driver; .ci/run does)"),
    pytest.mark.usefixtures("one_thread"),
]
ROOT = Path(__file__).resolve().parents[1]
XSS = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2; alert(2)"> <b>bold?</b>'
PROMPTS = ["Say hi", "Name a fruit", "Count to three", "Name a colour"]


def start(argv: list[str]) -> tuple[subprocess.Popen, str]:
    """``ppolm label`` in its own process; returns it and the page's address, once it listens."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ppolm", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    line = proc.stdout.readline()  # "labelling ... open http://127.0.0.1:PORT/"
    found = re.search(r"open (http://\S+)", line)
    if not found:
        proc.kill()
        raise AssertionError(f"ppolm label did not start: {line!r} {proc.stderr.read()}")
    return proc, found.group(1)


@pytest.fixture()
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=opts)
    yield driver
    driver.quit()


def test_rank_in_a_browser_kill_restart_finish_and_train(tiny_policy_dir, tmp_path, browser):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "labels"
    options = dict(model=str(tiny_policy_dir), prompts=str(prompts), k=3, output_dir=str(out), response_length=8,
                   device="cpu", precision="fp32", batch_size=1)
    argv = ["label", *[x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v))], "--port", "0"]
    # the first prompt's answers are written beforehand (one holds HTML and script); the server's
    # sampler fills in the other three in the background
    cfg = config.build(LabelConfig, options)
    store = LabelStore(out, label.settings(cfg, len(PROMPTS)), PROMPTS)
    store.add_answers(0, [XSS, "A calm answer.", "<i>not italic</i>"])
    del store

    wait = WebDriverWait(browser, 60, poll_frequency=0.1)

    def counter() -> str:
        return browser.find_element(By.ID, "counter").text

    def showing(prompt: str, done: int) -> None:
        wait.until(lambda d: counter() == f"{done} / 4 judged" and d.find_element(By.ID, "prompt").text == prompt
                   and len(d.find_elements(By.CSS_SELECTOR, "#answers .answer")) == 3)

    def keys(*ks: str) -> None:
        ActionChains(browser).send_keys(*ks).perform()

    proc, url = start(argv)
    try:
        browser.get(url)
        showing("Say hi", 0)
        # the answer with HTML and script is text: no element made from it, no script run, no alert
        texts = [e.get_attribute("textContent") for e in browser.find_elements(By.CSS_SELECTOR, "#answers .text")]
        assert texts == [XSS, "A calm answer.", "<i>not italic</i>"]
        assert browser.find_elements(By.CSS_SELECTOR, "#answers img, #answers script, #answers b, #answers i") == []
        assert browser.execute_script("return window.pwned === undefined")
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018
        assert "Keys:" in browser.find_element(By.ID, "keys").text  # the keys are written on the page

        keys("2", "t", "1", Keys.ENTER)  # answers 2 and 1 tied, best; 3 (left over) last
        showing("Name a fruit", 1)  # sampled in the background
        keys("3", "1", Keys.ENTER)  # 3 > 1 > 2
        showing("Count to three", 2)
        keys("u")  # undo: prompt 2 comes back
        showing("Name a fruit", 1)
        for i in (1, 2):  # 2 > 3, and 1 is left over (each click redraws the cards)
            browser.find_elements(By.CSS_SELECTOR, "#answers .answer")[i].click()
        browser.find_element(By.ID, "note").send_keys("ranked by clicking")
        browser.find_element(By.ID, "save").click()
        showing("Count to three", 2)
        assert len((out / "judgements.jsonl").read_text().splitlines()) == 2
    finally:
        proc.send_signal(signal.SIGKILL)  # killed, not stopped: nothing may be lost
        proc.wait(30)

    proc, url = start(argv)
    try:
        browser.get(url)
        showing("Count to three", 2)  # the judged prompts are not shown again
        keys("1", "2", "3", Keys.ENTER)
        showing("Name a colour", 3)
        keys("3", "2", Keys.ENTER)
        wait.until(lambda d: counter() == "4 / 4 judged" and "All 4 prompts are judged" in
                   d.find_element(By.ID, "prompt").text)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    assert "stopped: 4/4 prompts judged" in proc.stdout.read()

    judgements = [json.loads(x) for x in (out / "judgements.jsonl").read_text().splitlines()]
    assert [(j["index"], j["ranking"], j["note"], j["skipped"]) for j in judgements] == [
        (0, [[1, 0], [2]], "", False),
        (1, [[1], [2], [0]], "ranked by clicking", False),
        (2, [[0], [1], [2]], "", False),
        (3, [[2], [1], [0]], "", False),
    ]
    answers = {a["index"]: a["answers"] for a in map(json.loads, (out / "answers.jsonl").read_text().splitlines())}
    assert sorted(answers) == [0, 1, 2, 3] and answers[0][0] == XSS
    assert all(j["answers"] == answers[j["index"]] and j["labeller"] == "person" for j in judgements)
    assert all(j["model"] == str(tiny_policy_dir) and j["sampling"]["response_length"] == 8 for j in judgements)
    pairs = [json.loads(x) for x in (out / "pairs.jsonl").read_text().splitlines()]
    assert pairs == [p for j in judgements for p in expand_pairs(j)]
    assert len(pairs) == 2 + 3 + 3 + 3  # the tie in the first ranking gives no pair

    rm = tmp_path / "rm"
    assert main(["reward", "--model", str(tiny_policy_dir), "--data", str(out / "pairs.jsonl"), "--group-by-prompt",
                 "--eval-fraction", "0", "--output-dir", str(rm), "--epochs", "1", "--batch-size", "4",
                 "--no-normalize", "--precision", "fp32", "--device", "cpu", "--quiet"]) == 0
    rows = [json.loads(x) for x in (rm / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r.get("train_loss") is None or r["train_loss"] > 0 for r in rows)
    assert (rm / "model.safetensors").is_file()
