"""Reward services (``--reward-url``) against real servers on 127.0.0.1: the request OpenRLHF's
services expect, batches cut and shared over replicas, retries with backoff, and every failure's
documented outcome (one error line on the first batch; NaN, the non-finite guard and its skip
count later); then ``ppolm ppo --reward-url`` fed by ``ppolm serve-rm``, whose scores equal the
in-process ones of the same reward model."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import socket
import time

import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ppolm import config
from ppolm.cli import main
from ppolm.errors import PPOLMError
from ppolm.judge import build_sources
from ppolm.models import load_tokenizer
from ppolm.ppo import train_ppo
from ppolm.ppo_config import PPOConfig
from ppolm.remote import RemoteReward, endpoint, shards
from ppolm.rewards import Rewarder
from ppolm.serve_rm import RunningServer, ServeRMConfig, bind, start
from ppolm.tiny import build_tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


class Service:
    """A test reward service: one route per behaviour; ``calls[route]`` holds each request's body."""

    def __init__(self):
        self.calls: dict[str, list[dict]] = {}

        def reply(content, status=200):
            return Response(json.dumps(content, allow_nan=True), status_code=status, media_type="application/json")

        def route(name, behave):
            async def handler(request: Request):
                body = await request.json()
                self.calls.setdefault(name, []).append(body)
                return await behave(body, len(self.calls[name]))
            return Route("/" + name, handler, methods=["POST"])

        async def ok(body, n):
            return reply({"rewards": [len(q) / 100 for q in body["query"]]})

        async def fail(body, n):
            return reply({"error": "boom"}, 500)

        async def stall(body, n):
            await asyncio.sleep(3)
            return reply({"rewards": [0.0] * len(body["query"])})

        async def trickle(body, n):  # a byte every 0.1 s: each read is quick, the whole answer is not
            async def chunks():
                for _ in range(30):
                    await asyncio.sleep(0.1)
                    yield b" "
            return StreamingResponse(chunks(), media_type="application/json")

        async def wrong_count(body, n):
            return reply({"rewards": [0.0] * (len(body["query"]) + 1)})

        async def nan(body, n):
            return reply({"rewards": [float("nan")] * len(body["query"])})

        async def strings(body, n):
            return reply({"rewards": ["high"] * len(body["query"])})

        async def not_json(body, n):
            return Response("hello", media_type="text/plain")

        async def no_rewards(body, n):
            return reply({"scores": [0.0] * len(body["query"])})

        async def refused(body, n):
            return reply({"error": "bad request"}, 400)

        async def flaky(body, n):  # two 503s, then answers
            return reply({"error": "busy"}, 503) if n <= 2 else await ok(body, n)

        async def nan_later(body, n):
            return await ok(body, n) if n == 1 else await nan(body, n)

        async def down_later(body, n):
            return await ok(body, n) if n == 1 else await fail(body, n)

        behaviours = dict(ok=ok, ok2=ok, get_reward=ok, fail=fail, stall=stall, trickle=trickle, wrong_count=wrong_count, nan=nan,
                          strings=strings, not_json=not_json, no_rewards=no_rewards, refused=refused, flaky=flaky,
                          nan_later=nan_later, down_later=down_later)
        self.server = RunningServer(Starlette(routes=[route(k, v) for k, v in behaviours.items()]),
                                    bind("127.0.0.1", 0)).start()
        self.url = self.server.url


@pytest.fixture(scope="module")
def service():
    s = Service()
    yield s
    s.server.stop()


def score(source, queries, **columns):
    """Score ``queries`` (as their own prompts and completions) with one source through a Rewarder."""
    rewarder = Rewarder([], [source])
    total, parts = rewarder.score(model_inputs=None, prompts=[q[:2] for q in queries], completions=queries,
                                  columns=columns, queries=queries, prompt_texts=[q[:2] for q in queries])
    return total, parts


QUERIES = ["ab", "abcd", "abcdefgh"]


def test_request_body_and_scores(service):
    src = RemoteReward("svc", [service.url + "/ok"], weight=2.0)
    total, parts = score(src, QUERIES, label=["x", None, "z"], other=[1, 2, 3])
    assert parts["reward/svc"].tolist() == pytest.approx([0.02, 0.04, 0.08])
    assert total.tolist() == pytest.approx([0.04, 0.08, 0.16])  # weighted
    assert service.calls["ok"][-1] == {"query": QUERIES, "prompts": ["ab", "ab", "ab"], "labels": ["x", None, "z"]}
    # labels JSON cannot hold as they are (a parquet column's array scalars, NaN, objects) still go
    score(src, QUERIES, label=[torch.tensor(3), float("nan"), {1, 2}])
    assert service.calls["ok"][-1]["labels"] == [3, None, "{1, 2}"]


def test_url_without_path_goes_to_get_reward(service):
    assert endpoint("http://h:5/", "x") == "http://h:5/get_reward"
    assert endpoint("http://h:5/score", "x") == "http://h:5/score"
    before = len(service.calls.get("get_reward", []))
    score(RemoteReward("svc", [service.url]), QUERIES)
    assert len(service.calls["get_reward"]) == before + 1
    for bad in ("ftp://h/x", "h:5", "http://user:pw@h:5"):
        with pytest.raises(PPOLMError, match="--reward-url"):
            endpoint(bad, "--reward-url")


def test_batches_are_cut_and_dealt_to_replicas(service):
    assert [len(r) for r in shards(10, 3, 2)] == [2, 3, 3, 2]  # ceil(10 / 3) = 4 requests
    assert [len(r) for r in shards(3, 64, 2)] == [2, 1]  # one per replica while rows last
    assert [len(r) for r in shards(1, 64, 4)] == [1] and shards(0, 64, 2) == []
    service.calls.pop("ok", None), service.calls.pop("ok2", None)
    queries = ["x" * (i + 1) for i in range(10)]
    src = RemoteReward("svc", [service.url + "/ok", service.url + "/ok2"], batch_size=3)
    _, parts = score(src, queries)
    assert parts["reward/svc"].tolist() == pytest.approx([(i + 1) / 100 for i in range(10)])  # order kept
    # requests 0 (rows 0-1) and 2 (rows 5-7) to the first replica, 1 (rows 2-4) and 3 (rows 8-9) to the
    # second, sent at once (so in either order)
    assert sorted(b["query"] for b in service.calls["ok"]) == [queries[0:2], queries[5:8]]
    assert sorted(b["query"] for b in service.calls["ok2"]) == [queries[2:5], queries[8:10]]


@pytest.mark.parametrize("route, message", [
    ("fail", r"reward service http://127\.0\.0\.1:\d+/fail answered HTTP 500: .*boom.* \(1 try\); check that"),
    ("stall", r"/stall did not answer within 0\.3 s \(1 try\)"),
    ("trickle", r"/trickle did not answer within 0\.3 s \(1 try\)"),
    ("wrong_count", r"/wrong_count returned 4 rewards for 3 queries; it must return one per query"),
    ("nan", r"reward service .* returned nan for row 0 of its first batch; a reward must be a finite number"),
    ("strings", r"returned \"high\" \(str\) as reward 0; each must be a number"),
    ("not_json", r"answered with a body that is not JSON: hello"),
    ("no_rewards", r"answered without a 'rewards' list \(got scores\)"),
    ("refused", r"answered HTTP 400: .*bad request"),
])
def test_failures_on_the_first_batch_are_one_error(service, route, message):
    src = RemoteReward("svc", [f"{service.url}/{route}"], timeout=0.3, retries=0)
    t0 = time.monotonic()
    with pytest.raises(PPOLMError, match=message):
        score(src, QUERIES)
    assert time.monotonic() - t0 < 2.5  # never a hang: the stalling service is given up on at its timeout


def test_a_service_that_is_down(service):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = RemoteReward("svc", [f"http://127.0.0.1:{port}"], timeout=2, retries=1)
    t0 = time.monotonic()
    with pytest.raises(PPOLMError, match=rf"127\.0\.0\.1:{port}/get_reward cannot be reached \(Connect.*\(2 tries\)"):
        score(src, QUERIES)
    assert 0.5 <= time.monotonic() - t0 < 5  # one backoff of 0.5 s between the tries


def test_retries_with_backoff_reach_a_flaky_service(service):
    service.calls.pop("flaky", None)
    src = RemoteReward("svc", [service.url + "/flaky"], retries=2)
    t0 = time.monotonic()
    _, parts = score(src, QUERIES)
    assert parts["reward/svc"].tolist() == pytest.approx([0.02, 0.04, 0.08])
    assert len(service.calls["flaky"]) == 3 and time.monotonic() - t0 >= 1.5  # waits of 0.5 s and 1 s
    service.calls.pop("flaky")
    with pytest.raises(PPOLMError, match=r"answered HTTP 503.*\(2 tries\)"):
        score(RemoteReward("svc", [service.url + "/flaky"], retries=1), QUERIES)


def test_later_failures_score_nan(service, capsys):
    """Once a service has answered, a failed request or a non-finite reward is a NaN score (the
    trainer's non-finite guard skips the update); a wrong answer stays an error."""
    for route in ("nan_later", "down_later"):
        service.calls.pop(route, None)
        src = RemoteReward("svc", [f"{service.url}/{route}"], retries=0)
        assert torch.isfinite(score(src, QUERIES)[1]["reward/svc"]).all()
        later = score(src, QUERIES)[1]["reward/svc"]
        assert torch.isnan(later).all()
    err = capsys.readouterr().err
    assert "warning: reward service" in err and "/down_later answered HTTP 500" in err and "3 rows score NaN" in err
    src = RemoteReward("svc", [service.url + "/wrong_count"], retries=0)
    src.answered = True
    with pytest.raises(PPOLMError, match="returned 4 rewards for 3 queries"):
        score(src, QUERIES)


def test_options_are_checked_before_anything_loads(tmp_path):
    def cfg(**over):
        return config.build(PPOConfig, {"output_dir": str(tmp_path / "x"), **over})

    with pytest.raises(PPOLMError, match="--reward-url-weights has 2 values for 1 --reward-url"):
        cfg(reward_url=["http://127.0.0.1:1"], reward_url_weights=[1.0, 2.0]).validate()
    with pytest.raises(PPOLMError, match="--reward-url-timeout must be > 0"):
        cfg(reward_url=["http://127.0.0.1:1"], reward_url_timeout=0).validate()
    with pytest.raises(PPOLMError, match="--reward-url-retries must be >= 0"):
        cfg(reward_url=["http://127.0.0.1:1"], reward_url_retries=-1).validate()
    cfg(reward_url=["http://127.0.0.1:1"]).validate()  # a reward service alone is a reward
    with pytest.raises(PPOLMError, match="'ftp://x' is not an http"):
        build_sources(cfg(reward_url=["ftp://x"]).reward, set())
    sources = build_sources(cfg(reward_url=["http://a:1,http://b:2/s", "http://a:1"], reward_url_weights=[1, 3]).reward,
                            set())
    assert [s.name for s in sources] == ["a:1", "a:1_2"] and [s.weight for s in sources] == [1, 3]
    assert sources[0].endpoints == ["http://a:1/get_reward", "http://b:2/s"]


# ------------------------------------------------------------------ ppolm ppo --reward-url, end to end

@pytest.fixture(scope="module")
def micro_policy(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("micro") / "policy", kind="causal", seed=0, num_layers=1,
                                hidden_size=16, heads=2, kv_heads=1, intermediate_size=32)


@pytest.fixture(scope="module")
def other_vocab_rm(tiny_rm_dir, tmp_path_factory):
    """The tiny reward model with one token added to its tokenizer: its vocabulary differs from the
    policy's, so in-process PPO scores it on the decoded text, as a reward service does."""
    d = tmp_path_factory.mktemp("rm") / "rm_text"
    shutil.copytree(tiny_rm_dir, d)
    tok = load_tokenizer(d)
    tok.add_special_tokens({"additional_special_tokens": ["<|ppolm_test|>"]})
    tok.save_pretrained(d)
    return d


def ppo_cfg(policy, out, **over):
    base = dict(model=str(policy), steps=2, batch_size=4, minibatches=1, ppo_epochs=1, response_length=6,
                output_dir=str(out), quiet=True, precision="fp32", device="cpu", save_every=10)
    base.update(over)
    return config.build(PPOConfig, base)


def test_ppo_with_serve_rm_scores_as_in_process(micro_policy, other_vocab_rm, tmp_path):
    assert load_tokenizer(other_vocab_rm).get_vocab() != load_tokenizer(micro_policy).get_vocab()
    server = start(config.build(ServeRMConfig, {"reward_model": str(other_vocab_rm), "port": 0, "precision": "fp32",
                                                "device": "cpu"}))
    try:
        held = tmp_path / "held.txt"
        held.write_text("Say something.\nName a colour.\nCount to three.\n")
        cfg = ppo_cfg(micro_policy, tmp_path / "run", reward_model=[str(other_vocab_rm)], reward_url=[server.url],
                      reward_url_weights=[0.0], critic_init="policy", eval_prompts=str(held), eval_every=1)
        result = train_ppo(cfg)
        health = json.loads(httpx.get(server.url + "/health").text)
    finally:
        server.stop()
    name = f"127.0.0.1:{server.port}"
    assert len(result.metrics) == 2 and health["requests"] == 2 + 3  # 2 steps, held-out scores at 0, 1, 2 updates
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert len(evals) == 3
    for row in evals:  # the held-out prompts are scored by the service too, as in-process
        assert row[f"eval/{name}"] == pytest.approx(row["eval/rm_text"], abs=1e-6)
    for row in result.metrics:
        assert math.isfinite(row["reward/rm_text"])
        assert row[f"reward/{name}"] == pytest.approx(row["reward/rm_text"], abs=1e-6)
        assert row["objective/scores"] == pytest.approx(row["reward/rm_text"], abs=1e-6)  # the service's weight is 0
    assert result.metrics[0]["reward/rm_text"] != result.metrics[1]["reward/rm_text"]


def test_ppo_with_a_failing_service_stops_before_writing(service, micro_policy, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["ppo", "--model", str(micro_policy), "--reward-url", service.url + "/fail", "--reward-url-retries", "0",
            "--steps", "2", "--batch-size", "4", "--response-length", "4", "--output-dir", str(out), "--quiet",
            "--precision", "fp32", "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert errors[0].startswith("error: reward service http://127.0.0.1:") and "/fail answered HTTP 500" in errors[0]
    assert not out.exists()


def test_ppo_skips_the_update_of_a_later_nan(service, micro_policy, tmp_path):
    service.calls.pop("nan_later", None)
    result = train_ppo(ppo_cfg(micro_policy, tmp_path / "run", reward_url=[service.url + "/nan_later"],
                               advantage="rloo", samples_per_prompt=2))
    assert [r["guard/skipped_updates"] for r in result.metrics] == [0, 1]
    assert result.metrics[1]["reward/127.0.0.1:" + str(service.server.port)] is None  # non-finite: null
    assert len(service.calls["nan_later"]) == 2
