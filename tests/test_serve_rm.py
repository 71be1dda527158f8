"""``ppolm serve-rm``: a tiny reward model served on 127.0.0.1 (a free port) scores over HTTP what it
scores in-process, normalisation included; concurrent requests share forward passes; bad requests
get HTTP 400 with a JSON error; the command runs as a real process and stops on Ctrl-C."""

from __future__ import annotations

import concurrent.futures
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from ppolm import config
from ppolm.cli import main
from ppolm.rewards import RewardModel, write_norm
from ppolm.serve_rm import ServeRMConfig, start

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

TEXTS = ["Hello there, how are you today?", "A", "The quick brown fox jumps over the lazy dog. " * 3,
         "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>"]
GAIN, BIAS = 2.0, 0.5


@pytest.fixture(scope="module")
def normed_rm(tiny_rm_dir, tmp_path_factory):
    """The tiny reward model with a gain/bias normalisation stored beside it."""
    d = tmp_path_factory.mktemp("normed") / "normed_rm"
    shutil.copytree(tiny_rm_dir, d)
    write_norm(d, GAIN, BIAS)
    return d


@pytest.fixture(scope="module")
def served(normed_rm):
    cfg = config.build(ServeRMConfig, {"reward_model": str(normed_rm), "port": 0, "precision": "fp32",
                                       "device": "cpu", "batch_wait_ms": 200, "batch_size": 16})
    server = start(cfg)
    yield server
    server.stop()


def test_scores_over_http_equal_in_process_scores_with_normalisation(served, normed_rm, tiny_rm_dir):
    r = httpx.post(served.url + "/get_reward", timeout=30,
                   json={"query": TEXTS, "prompts": ["p"] * len(TEXTS), "labels": [None] * len(TEXTS)})
    assert r.status_code == 200
    got = torch.tensor(r.json()["rewards"])
    normed = RewardModel(str(normed_rm), dtype=torch.float32, device="cpu").score_texts(TEXTS)
    raw = RewardModel(str(tiny_rm_dir), dtype=torch.float32, device="cpu").score_texts(TEXTS)
    assert got.shape == (len(TEXTS),)
    assert torch.allclose(got, normed, atol=1e-6, rtol=0)
    assert torch.allclose(got, GAIN * raw + BIAS, atol=1e-5, rtol=0)  # the normalisation is applied
    assert float(raw.std()) > 1e-4  # the texts score differently: the comparison can fail
    assert httpx.post(served.url + "/get_reward", json={"query": []}).json() == {"rewards": []}


def test_concurrent_requests_share_forward_passes(served, normed_rm):
    expected = RewardModel(str(normed_rm), dtype=torch.float32, device="cpu").score_texts(TEXTS).tolist()
    before = httpx.get(served.url + "/health").json()

    def one(i: int) -> float:
        r = httpx.post(served.url + "/get_reward", json={"query": [TEXTS[i % len(TEXTS)]]}, timeout=30)
        return r.json()["rewards"][0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    after = httpx.get(served.url + "/health").json()
    for i, g in enumerate(got):  # each request got its own text's score back
        assert g == pytest.approx(expected[i % len(TEXTS)], abs=1e-6)
    assert after["requests"] - before["requests"] == 8
    assert after["forward_batches"] - before["forward_batches"] < 8  # gathered within --batch-wait-ms
    assert after["status"] == "ok" and after["model"] == "normed_rm"


@pytest.mark.parametrize("body, expect", [
    (b"not json", "not JSON"),
    (b'{"q": ["x"]}', "needs \\\"query\\\""),
    (b'{"query": "one text"}', "list of prompt+response strings"),
    (b'{"query": [1, 2]}', "list of prompt+response strings"),
    (b'[1, 2]', "needs \\\"query\\\""),
    (b'{"query": [""]}', "query 0 is an empty string"),
    (b'{"query": ["x", ""]}', "query 1 is an empty string"),
])
def test_bad_requests_get_400_with_a_json_error(served, body, expect):
    r = httpx.post(served.url + "/get_reward", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert expect.replace("\\", "") in r.json()["error"] and "Traceback" not in r.text


def test_wrong_path_and_method_get_json_errors(served):
    r = httpx.get(served.url + "/get_reward")
    assert r.status_code == 405 and "POST /get_reward" in r.json()["error"]
    r = httpx.post(served.url + "/nowhere", json={"query": ["x"]})
    assert r.status_code == 404 and "error" in r.json()


def test_cli_serves_on_a_free_port_and_stops_on_ctrl_c(normed_rm):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "ppolm", "serve-rm", "--reward-model", str(normed_rm), "--port",
                             "0", "--precision", "fp32", "--device", "cpu"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        line, end = "", time.monotonic() + 180
        while "serving" not in line and time.monotonic() < end and proc.poll() is None:
            if sel.select(timeout=1):
                line = proc.stdout.readline()
        m = re.search(r"at (http://127\.0\.0\.1:(\d+))/get_reward", line)
        assert m, (line, proc.poll())
        assert int(m.group(2)) > 0
        health = httpx.get(m.group(1) + "/health", timeout=10).json()
        assert health["status"] == "ok"
        rewards = httpx.post(m.group(1) + "/get_reward", json={"query": TEXTS[:2]}, timeout=30).json()["rewards"]
        expected = RewardModel(str(normed_rm), dtype=torch.float32, device="cpu").score_texts(TEXTS[:2]).tolist()
        assert rewards == pytest.approx(expected, abs=1e-6)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "Traceback" not in err and "reward server stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_bad_input_is_one_error_line(tmp_path, tiny_rm_dir, capsys):
    assert main(["serve-rm"]) == 2
    assert "serve-rm needs --reward-model DIR" in capsys.readouterr().err
    assert main(["serve-rm", "--reward-model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope" in err and "Traceback" not in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve-rm", "--reward-model", str(tiny_rm_dir), "--port", str(port)]) == 2
        assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err
    assert main(["serve-rm", "--reward-model", str(tiny_rm_dir), "--port", "70000"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err
