"""LLM judges behind an OpenAI-compatible /v1/chat/completions endpoint, against a small test server
on 127.0.0.1 that replies what a marker in the message asks for (a rating, garbage, a refusal):
ratings and choices parsed, unparsed replies counted and handled as documented, the API key sent
from its environment variable and never shown, templates from files, and ``ppolm ppo --reward-judge``."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ppolm import config
from ppolm.errors import PPOLMError
from ppolm.judge import JudgeReward, load_judge, load_llm_judge, parse_choice, parse_rating
from ppolm.ppo import train_ppo
from ppolm.ppo_config import PPOConfig
from ppolm.rewards import Rewarder
from ppolm.serve_rm import RunningServer, bind
from ppolm.tiny import build_tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

KEY = "sk-test-0123456789"


class ChatServer:
    """Replies with the text of the first <<reply:...>> marker in the user message; <<refuse>> gives
    an OpenAI-style refusal (content null); model 'locked' answers 401 without the right key;
    model 'broken' answers without choices; model 'slow' takes 3 s."""

    def __init__(self):
        self.requests: list[tuple[dict, str | None]] = []

        async def chat(request: Request) -> Response:
            body = await request.json()
            auth = request.headers.get("authorization")
            self.requests.append((body, auth))
            text = body["messages"][-1]["content"]
            if body["model"] == "locked" and auth != f"Bearer {KEY}":
                return Response(json.dumps({"error": {"message": "invalid api key"}}), 401,
                                media_type="application/json")
            if body["model"] == "broken":
                return Response(json.dumps({"object": "chat.completion"}), media_type="application/json")
            if body["model"] == "slow":
                await asyncio.sleep(3)
            message = {"role": "assistant", "content": "I am not sure."}
            m = re.search(r"<<reply:(.*?)>>", text, re.S)
            if m:
                message["content"] = m.group(1)
            elif "<<refuse>>" in text:
                message = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
            answer = {"id": "x", "object": "chat.completion", "model": body["model"],
                      "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
            return Response(json.dumps(answer), media_type="application/json")

        self.server = RunningServer(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]),
                                    bind("127.0.0.1", 0)).start()
        self.base = self.server.url + "/v1"


@pytest.fixture(scope="module")
def chat():
    s = ChatServer()
    yield s
    s.server.stop()


@pytest.mark.parametrize("reply, rating", [
    ("Rating: 7", 7.0), ("rating: 7.5", 7.5), ("**Score:** 8", 8.0), ("The answer is fine. [[9]]", 9.0),
    ("I'd give it 6/10.", 6.0), ("6 out of 10", 6.0), ("  4. ", 4.0), ("Rating: 3\nOn reflection, Rating: 5", 5.0),
    ("Rating: 11", None), ("Rating: 0", None), ("I cannot rate this.", None), ("", None), ("two", None),
])
def test_parse_rating(reply, rating):
    assert parse_rating(reply, 1, 10) == rating


@pytest.mark.parametrize("reply, p", [
    ("A", 1.0), ("B", 0.0), ("tie", 0.5), ("**B**", 0.0), ("Answer A.", 1.0), ("[[A]]", 1.0), ("[[C]]", 0.5),
    ("After comparing both, my verdict: B", 0.0), ("The better answer is B.", 0.0), ("Tie", 0.5),
    ("Both have merits", None), ("I cannot decide", None), ("a good question", None),
])
def test_parse_choice(reply, p):
    assert parse_choice(reply) == p


def test_reward_judge_scores_counts_and_fills_unparsed(chat):
    llm = load_llm_judge(f"openai:rater@{chat.base}", mode="pointwise")
    rewarder = Rewarder([], [JudgeReward("judge_rater", llm, weight=2.0)])
    comps = ["<<reply:Rating: 7>>", "<<reply:I'd say 10/10>>", "<<reply:lovely!>>", "<<refuse>>"]
    total, parts = rewarder.score(model_inputs=None, prompts=["Say hi."] * 4, completions=comps, columns={})
    mean = (6 / 9 + 9 / 9) / 2  # the rated answers' mean stands in for the two unrated ones
    assert parts["reward/judge_rater"].tolist() == pytest.approx([6 / 9, 1.0, mean, mean])
    assert parts["reward/judge_rater_unparsed"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert total.tolist() == pytest.approx([2 * 6 / 9, 2.0, 2 * mean, 2 * mean])
    assert llm.unparsed == 2 and llm.replies == 4
    body, auth = chat.requests[-1]
    assert body["model"] == "rater" and body["temperature"] == 0 and auth is None
    assert "Say hi." in body["messages"][0]["content"] and "Rating: N" in body["messages"][0]["content"]
    # a batch without a single rating scores NaN, for the trainer's non-finite guard
    _, parts = rewarder.score(model_inputs=None, prompts=["q"] * 2, completions=["<<refuse>>", "meh"], columns={})
    assert torch.isnan(parts["reward/judge_rater"]).all() and parts["reward/judge_rater_unparsed"].tolist() == [1, 1]


def test_pairwise_judge_labels(chat):
    judge = load_judge(f"openai:cmp@{chat.base}")
    assert judge.kind == "pairwise" and judge.llm.mode == "pairwise"
    prompts = ["<<reply:A>>", "<<reply:[[B]]>>", "<<reply:tie>>", "<<reply:hmm>>", "<<refuse>>"]
    probs = judge.preference(prompts, ["a1"] * 5, ["b1"] * 5)
    assert probs == [1.0, 0.0, 0.5, 0.5, 0.5]
    assert judge.unparsed == 2 and judge.calls == 5
    import random
    assert judge.label(prompts[:3], ["x"] * 3, ["y"] * 3, random.Random(0)) == [1.0, 0.0, 0.5]
    body = chat.requests[-1][0]["messages"][0]["content"]
    assert "[Answer A]\nx" in body and "[Answer B]\ny" in body
    # pointwise as --judge: Bradley-Terry on the two ratings
    pj = load_judge(f"openai:rate@{chat.base},mode=pointwise")
    assert pj.kind == "pointwise"
    assert pj.preference(["q"], ["<<reply:Rating: 8>>"], ["<<reply:Rating: 3>>"]) == [1.0]


def test_api_key_from_environment_never_shown(chat, monkeypatch):
    monkeypatch.setenv("PPOLM_TEST_KEY", KEY)
    llm = load_llm_judge(f"openai:locked@{chat.base},key_env=PPOLM_TEST_KEY", mode="pointwise")
    rewarder = Rewarder([], [JudgeReward("j", llm)])
    _, parts = rewarder.score(model_inputs=None, prompts=["q"], completions=["<<reply:Rating: 10>>"], columns={})
    assert parts["reward/j"].tolist() == [1.0]
    assert chat.requests[-1][1] == f"Bearer {KEY}"
    assert KEY not in repr(llm) and KEY not in repr(rewarder.functions)
    monkeypatch.setenv("PPOLM_TEST_KEY", "sk-wrong")
    wrong = load_llm_judge(f"openai:locked@{chat.base},key_env=PPOLM_TEST_KEY", mode="pointwise")
    with pytest.raises(PPOLMError, match="answered HTTP 401") as e:
        Rewarder([], [JudgeReward("j", wrong)]).score(model_inputs=None, prompts=["q"], completions=["c"], columns={})
    assert "sk-wrong" not in str(e.value)
    monkeypatch.delenv("PPOLM_TEST_KEY")
    with pytest.raises(PPOLMError, match="environment variable PPOLM_TEST_KEY \\(key_env=\\) is not set"):
        load_llm_judge(f"openai:locked@{chat.base},key_env=PPOLM_TEST_KEY")


def test_template_file_and_scale(chat, tmp_path):
    t = tmp_path / "t.txt"
    t.write_text("Q: {prompt}\nA: {response}\nJSON braces {\"stay\": 1} <<reply:Rating: 4>>")
    llm = load_llm_judge(f"openai:m@{chat.base},template={t},scale=0-4", mode="pointwise")
    _, parts = Rewarder([], [JudgeReward("j", llm)]).score(model_inputs=None, prompts=["why?"], completions=["because"],
                                                           columns={})
    assert parts["reward/j"].tolist() == [1.0]  # 4 on a 0-4 scale
    assert chat.requests[-1][0]["messages"][0]["content"].startswith('Q: why?\nA: because\nJSON braces {"stay": 1}')
    bad = tmp_path / "bad.txt"
    bad.write_text("Rate {response}")
    with pytest.raises(PPOLMError, match="lacks \\{prompt\\}"):
        load_llm_judge(f"openai:m@{chat.base},template={bad}", mode="pointwise")
    with pytest.raises(PPOLMError, match="cannot be read"):
        load_llm_judge(f"openai:m@{chat.base},template={tmp_path / 'none.txt'}")


@pytest.mark.parametrize("spec, message", [
    ("openai:@http://h/v1", "must be openai:MODEL@BASE_URL"),
    ("openai:m@http://h/v1,colour=red", "unknown option 'colour=red'"),
    ("openai:m@http://h/v1,mode=sideways", "mode must be"),
    ("openai:m@http://h/v1,timeout=-1", "timeout must be >= 0.001"),
    ("openai:m@http://h/v1,retries=x", "retries=x is not an integer"),
    ("openai:m@http://h/v1,scale=10-1", "scale must be LOW-HIGH"),
    ("openai:m@ftp://h/v1", "is not an http:// or https:// URL"),
])
def test_bad_specs(spec, message):
    with pytest.raises(PPOLMError, match=re.escape(message)):
        load_judge(spec)


def test_endpoint_failures_on_the_first_batch(chat):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for spec, message in ((f"openai:m@http://127.0.0.1:{port}/v1,retries=0", "cannot be reached"),
                          (f"openai:slow@{chat.base},timeout=0.3,retries=0", "did not answer within 0.3 s"),
                          (f"openai:broken@{chat.base}", "answered without choices[0].message")):
        src = JudgeReward("j", load_llm_judge(spec, mode="pointwise"))
        with pytest.raises(PPOLMError, match=re.escape(message)):
            Rewarder([], [src]).score(model_inputs=None, prompts=["q"], completions=["c"], columns={})
    assert load_llm_judge(f"openai:m@{chat.base}/chat/completions").url == chat.base + "/chat/completions"
    with pytest.raises(PPOLMError, match="--reward-judge|mode must be pointwise"):
        load_llm_judge(f"openai:m@{chat.base},mode=pairwise", mode="pointwise")


def test_ppo_with_reward_judge(chat, tmp_path):
    policy = build_tiny_model_dir(tmp_path / "policy", kind="causal", seed=0, num_layers=1, hidden_size=16, heads=2,
                                  kv_heads=1, intermediate_size=32)
    template = tmp_path / "t.txt"
    template.write_text("{prompt} {response} <<reply:Rating: 8>>")
    cfg = config.build(PPOConfig, dict(model=str(policy), steps=2, batch_size=4, minibatches=1, ppo_epochs=1,
                                       response_length=4, output_dir=str(tmp_path / "run"), quiet=True,
                                       precision="fp32", device="cpu", save_every=10,
                                       reward_judge=[f"openai:judge@{chat.base},template={template}"]))
    result = train_ppo(cfg)
    for row in result.metrics:
        assert row["reward/judge_judge"] == pytest.approx(7 / 9)
        assert row["reward/judge_judge_unparsed"] == 0.0
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "openai:judge@" in saved
