"""``ppolm label`` without a browser: pairs from rankings by hand, the judge mode end to end on a tiny
model, resuming, and the web server (a real uvicorn on a free local port) refusing bad requests."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from ppolm import config, label, label_store
from ppolm.cli import main
from ppolm.label import LabelConfig
from ppolm.label_store import LabelStore, expand_pairs, ranking_from_labels

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

HTML = '<script>alert(1)</script><img src=x onerror="alert(2)"> & "quotes"'


# ------------------------------------------------------------------------------------ pairs by hand

def test_pairs_from_a_ranking_by_hand():
    j = {"id": "j1", "prompt": "p", "answers": ["a", "b", "c", "d"], "ranking": [[2], [0, 3], [1]],
         "model": "m", "sampling": {"temperature": 1.0}, "labeller": "person", "time": "t"}
    got = [(r["chosen"], r["rejected"]) for r in expand_pairs(j)]
    # c beats everyone; a and d are tied (no pair between them) and both beat b
    assert got == [("c", "a"), ("c", "d"), ("c", "b"), ("a", "b"), ("d", "b")]
    row = expand_pairs(j)[0]
    assert (row["prompt"], row["model"], row["sampling"], row["judgement"], row["time"]) == \
        ("p", "m", {"temperature": 1.0}, "j1", "t")
    assert (row["chosen_answer"], row["rejected_answer"]) == (2, 0)
    assert expand_pairs({**j, "ranking": [[0, 1, 2, 3]]}) == []  # all tied: nothing preferred
    assert expand_pairs({**j, "ranking": [], "skipped": True}) == []
    # the same text twice, or an empty answer, prefers nothing
    same = {**j, "answers": ["x", "x ", "", "y"], "ranking": [[0], [1], [2], [3]]}
    assert [(r["chosen"], r["rejected"]) for r in expand_pairs(same)] == [("x", "y"), ("x ", "y")]


def test_ranking_from_labels_by_hand():
    pairs = [(0, 1), (0, 2), (1, 2)]
    assert ranking_from_labels(3, pairs, [0.0, 0.0, 0.0]) == [[2], [1], [0]]  # 2 > 1 > 0
    assert ranking_from_labels(3, pairs, [1.0, 0.5, 0.0]) == [[0, 2], [1]]  # wins 1.5, 0, 1.5
    assert ranking_from_labels(3, pairs, [1.0, 0.0, 1.0]) == [[0, 1, 2]]  # a cycle: all tied


# ------------------------------------------------------------------------------------ judge mode

@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("label_inputs")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "answer": "hi"}) + "\n"
                               for p in ["Say hi", "Name a fruit", "Count to three", "Name a colour"]))
    judge = d / "judge.py"
    judge.write_text("def shortest(prompts, completions, answer, **kwargs):\n"
                     "    assert all(a == 'hi' for a in answer)  # the prompts' columns reach the judge\n"
                     "    return [-len(c) for c in completions]\n")
    return {"prompts": prompts, "judge": f"{judge}:shortest"}


def label_argv(model, inputs, out, *more):
    return ["label", "--model", str(model), "--prompts", str(inputs["prompts"]), "--k", "3", "--output-dir", str(out),
            "--response-length", "6", "--batch-size", "3", "--device", "cpu", "--precision", "fp32", *more]


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_judge_mode_end_to_end_and_resume(tiny_policy_dir, inputs, tmp_path, capsys):
    out = tmp_path / "labels"
    assert main(label_argv(tiny_policy_dir, inputs, out, "--judge", inputs["judge"])) == 0
    answers, judgements = read(out / "answers.jsonl"), read(out / "judgements.jsonl")
    assert [a["index"] for a in answers] == [0, 1, 2, 3] and all(len(a["answers"]) == 3 for a in answers)
    assert [j["index"] for j in judgements] == [0, 1, 2, 3]
    for a, j in zip(answers, judgements):
        assert j["answers"] == a["answers"] and j["labeller"] == f"judge:{inputs['judge']}"
        lengths = [len(x) for x in a["answers"]]
        # the judge prefers the shortest: its ranking is the order of the lengths (equal lengths tie)
        assert [lengths[g[0]] for g in j["ranking"]] == sorted(set(lengths))
        assert j["sampling"] == {"response_length": 6, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                 "chat_template": True, "seed": 0}
    pairs = read(out / "pairs.jsonl")
    assert pairs == [p for j in judgements for p in expand_pairs(j)] and pairs
    assert all(len(p["chosen"]) < len(p["rejected"]) for p in pairs)

    # rerun: nothing is sampled or judged again
    before = {f: (out / f).read_bytes() for f in label_store.FILES}
    assert main(label_argv(tiny_policy_dir, inputs, out, "--judge", inputs["judge"])) == 0
    assert {f: (out / f).read_bytes() for f in label_store.FILES} == before
    assert "ranked 0 prompts (4/4 judged)" in capsys.readouterr().out

    # other settings in the same directory are refused, and nothing changes
    assert main(label_argv(tiny_policy_dir, inputs, out, "--judge", inputs["judge"], "--temperature", "0.7")) == 2
    assert "other settings (sampling:" in capsys.readouterr().err
    assert {f: (out / f).read_bytes() for f in label_store.FILES} == before

    # ppolm reward trains on the pairs as written (one step, tiny model)
    rm = tmp_path / "rm"
    assert main(["reward", "--model", str(tiny_policy_dir), "--data", str(out / "pairs.jsonl"), "--group-by-prompt",
                 "--eval-fraction", "0", "--output-dir", str(rm), "--epochs", "1", "--batch-size", "8",
                 "--no-normalize", "--precision", "fp32", "--device", "cpu", "--quiet"]) == 0
    assert (rm / "model.safetensors").is_file()


def test_resume_after_a_crash_keeps_every_whole_line(tiny_policy_dir, inputs, tmp_path):
    """A process killed while appending leaves at most one unfinished last line: it is dropped, the
    judgements before it are kept, and the rest of the prompts are judged on the rerun."""
    out = tmp_path / "labels"
    cfg = config.build(LabelConfig, dict(model=str(tiny_policy_dir), prompts=str(inputs["prompts"]), k=3,
                                         output_dir=str(out), response_length=6, device="cpu", precision="fp32"))
    store, sampler = label.prepare(cfg)
    sampler.run()
    store.submit({"index": 0, "ranking": [[1], [0], [2]], "note": "first"})
    store.submit({"index": 1, "skip": True})
    kept = (out / "judgements.jsonl").read_bytes()
    with open(out / "judgements.jsonl", "ab") as f:
        f.write(b'{"id": "cut", "index": 2, "ranki')  # killed mid-write
    store, sampler = label.prepare(cfg)
    assert (out / "judgements.jsonl").read_bytes() == kept
    assert store.judged == {0, 1} and store.next_index() == 2
    assert store.judgements[0]["note"] == "first" and store.judgements[1]["skipped"]
    assert store.missing() == []  # the answers are not sampled again
    assert len(read(out / "pairs.jsonl")) == 3  # 1 > 0 > 2 gives 3 pairs; the skip gives none


def test_bad_options_are_one_line(tiny_policy_dir, inputs, tmp_path, capsys):
    assert main(label_argv(tiny_policy_dir, inputs, tmp_path / "a", "--k", "1")) == 2
    assert "--k must be at least 2" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("x")
    assert main(label_argv(tiny_policy_dir, inputs, tmp_path / "busy")) == 2
    assert "holds other files" in capsys.readouterr().err
    assert main(label_argv(tiny_policy_dir, inputs, tmp_path / "b", "--host", "0.0.0.0", "--token-env",
                           "PPOLM_TEST_NO_SUCH_VAR")) == 2
    assert "PPOLM_TEST_NO_SUCH_VAR" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------------------------ the server

class Server:
    """``make_app`` served by a real uvicorn on a free local port, in a thread."""

    def __init__(self, store, token=None, hosts=label.LOCAL_HOSTS):
        import uvicorn

        sock = label.bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(label.make_app(store, token, hosts), log_level="error",
                                                    access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)

    def request(self, path, body=None, headers=None, raw=None, method=None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request(self.url + path, data=data, headers={**h, **(headers or {})}, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


def make_store(tmp_path, k=3):
    prompts = ["Say hi", [{"role": "user", "content": "Name a <b>fruit</b>"}]]
    store = LabelStore(tmp_path / "labels", {"model": "m", "prompts": "p", "n_prompts": 2, "k": k,
                                             "sampling": {"temperature": 1.0}}, prompts)
    store.add_answers(0, [HTML, "plain", "<i>x</i>"])
    store.add_answers(1, ["one", "two", "three"])
    store.sampling_done.set()
    return store


@pytest.fixture()
def served(tmp_path):
    store = make_store(tmp_path)
    srv = Server(store)
    yield store, srv
    srv.stop()


def test_html_in_answers_is_stored_and_served_verbatim(served):
    store, srv = served
    status, body = srv.request("/api/state")
    state = json.loads(body)
    assert status == 200 and state["item"]["answers"][0] == HTML and state["total"] == 2
    status, body = srv.request("/api/judgement", {"index": 0, "ranking": [[0], [2, 1]], "note": "<b>n</b>"})
    assert status == 200 and json.loads(body)["item"]["prompt"] == "user: Name a <b>fruit</b>"
    j = read(store.out / "judgements.jsonl")[0]
    assert j["answers"][0] == HTML and j["note"] == "<b>n</b>" and j["ranking"] == [[0], [2, 1]]
    assert [(p["chosen"], p["rejected"]) for p in read(store.out / "pairs.jsonl")] == [(HTML, "<i>x</i>"),
                                                                                      (HTML, "plain")]
    # the page itself carries no model text, and its policy lets only its own script run
    status, page = srv.request("/")
    assert status == 200 and b"fruit" not in page
    req = urllib.request.urlopen(srv.url + "/", timeout=10)
    csp = req.headers["Content-Security-Policy"]
    assert "script-src 'sha256-" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]


def test_malformed_requests_leave_the_files_intact(served):
    store, srv = served
    assert srv.request("/api/judgement", {"index": 0, "ranking": [[1], [0, 2]]})[0] == 200
    files = {f: (store.out / f).read_bytes() for f in label_store.FILES}
    bad = [
        ({"raw": b"{not json"}, 400), ({"raw": b"\xff\xfe"}, 400), ({"body": [1, 2]}, 400),
        ({"body": {"index": 1, "ranking": [[0], [1]]}}, 400),  # answer 2 missing
        ({"body": {"index": 1, "ranking": [[0], [1], [1, 2]]}}, 400),  # answer 1 twice
        ({"body": {"index": 1, "ranking": [[0], [], [1, 2]]}}, 400),  # an empty group
        ({"body": {"index": 1, "ranking": [[0], [1], [3]]}}, 400),  # no answer 3
        ({"body": {"index": 1, "ranking": [["0"], [1], [2]]}}, 400),
        ({"body": {"index": True, "ranking": [[0], [1], [2]]}}, 400),
        ({"body": {"index": 1, "ranking": [[0], [1], [2]], "extra": 1}}, 400),
        ({"body": {"index": 1, "ranking": [[0], [1], [2]], "note": "x" * 3000}}, 400),
        ({"body": {"index": 1, "skip": "yes"}}, 400),
        ({"body": {"index": 1, "skip": True, "ranking": [[0], [1], [2]]}}, 400),
        ({"body": {"index": 7, "ranking": [[0], [1], [2]]}}, 404),
        ({"body": {"index": 0, "ranking": [[0], [1], [2]]}}, 409),  # already judged
        ({"raw": b"x" * (label.MAX_BODY + 1)}, 413),
        ({"body": {"index": 1, "ranking": [[0], [1], [2]]}, "headers": {"Content-Type": "text/plain"}}, 415),
        ({"body": {"index": 1, "ranking": [[0], [1], [2]]}, "headers": {"Origin": "http://evil.example"}}, 403),
        ({"body": {"index": 1, "ranking": [[0], [1], [2]]}, "headers": {"Host": "evil.example"}}, 400),
    ]
    for kw, want in bad:
        status, body = srv.request("/api/judgement", **kw)
        assert status == want, (kw, status, body)
        assert set(json.loads(body)) == {"error"}  # one JSON error, no traceback
    assert srv.request("/api/undo", {"id": "not-the-last"})[0] == 409
    assert srv.request("/api/judgement", method="GET")[0] == 405
    assert srv.request("/no/such/page")[0] == 404
    assert {f: (store.out / f).read_bytes() for f in label_store.FILES} == files
    # and the store still takes a good judgement, then an undo of it
    status, body = srv.request("/api/judgement", {"index": 1, "skip": True})
    assert status == 200 and json.loads(body)["done"] == 2
    status, body = srv.request("/api/undo", {"id": json.loads(body)["last"]})
    assert status == 200 and json.loads(body)["undone"] == 1 and json.loads(body)["item"]["index"] == 1
    assert {f: (store.out / f).read_bytes() for f in label_store.FILES} == files


def test_a_token_is_required_when_one_is_set(tmp_path):
    store = make_store(tmp_path)
    token = "s3cret-token-0123456789"
    srv = Server(store, token=token, hosts=None)
    try:
        for path, body in [("/", None), ("/api/state", None), ("/api/judgement", {"index": 0, "skip": True}),
                           ("/api/undo", {})]:
            assert srv.request(path, body)[0] == 401
            assert srv.request(path, body, headers={"X-PPOLM-Token": token[:-1] + "x"})[0] == 401
        assert not (store.out / "judgements.jsonl").exists()
        assert srv.request("/", headers={"Host": "some.lan:80"}, raw=None)[0] == 401
        assert srv.request(f"/?token={token}")[0] == 200
        assert srv.request("/api/state", headers={"X-PPOLM-Token": token})[0] == 200
        assert srv.request("/api/judgement", {"index": 0, "skip": True}, headers={"X-PPOLM-Token": token})[0] == 200
        assert len(read(store.out / "judgements.jsonl")) == 1
    finally:
        srv.stop()


def test_access_token_rules(monkeypatch):
    base = dict(model="m")
    assert label.access_token(config.build(LabelConfig, base)) is None  # 127.0.0.1: none needed
    made = label.access_token(config.build(LabelConfig, {**base, "host": "0.0.0.0"}))
    assert made and len(made) >= 24
    monkeypatch.setenv("PPOLM_LABEL_TOKEN", "x" * 20)
    assert label.access_token(config.build(LabelConfig, {**base, "host": "0.0.0.0",
                                                         "token_env": "PPOLM_LABEL_TOKEN"})) == "x" * 20
    monkeypatch.setenv("PPOLM_LABEL_TOKEN", "short")
    with pytest.raises(label.PPOLMError, match="at least 16"):
        label.access_token(config.build(LabelConfig, {**base, "token_env": "PPOLM_LABEL_TOKEN"}))


# ------------------------------------------------------------------------------------ rounds

def test_reference_of_follows_rounds_back_to_the_first(tmp_path):
    from ppolm.ppo_models import reference_of

    def run(name, model, ref=None):
        d = tmp_path / name
        (d / "policy").mkdir(parents=True)
        (d / "config.yaml").write_text(json.dumps({"model": {"model": model, "ref_model": ref}}))
        return str(d / "policy")

    r1 = run("r1", "sft")
    r2 = run("r2", r1)
    r3 = run("r3", r2)
    assert reference_of(r3, None) == reference_of(r2, None) == reference_of(r1, None) == "sft"
    assert reference_of(r3, "chosen") == "chosen"
    assert reference_of(run("r4", r3, ref="other"), None) == "other"  # a run's own --ref-model is its reference
    assert reference_of(str(tmp_path), None) == str(tmp_path)  # not a run's policy/: itself


def ppo_argv(model, rm, prompts, out, *more):
    return ["ppo", "--model", str(model), "--reward-model", str(rm), "--prompts", str(prompts), "--steps", "1",
            "--batch-size", "4", "--minibatches", "2", "--ppo-epochs", "1", "--response-length", "4",
            "--precision", "fp32", "--device", "cpu", "--quiet", "--output-dir", str(out), *more]


def reward_argv(model, out, data, *more):
    return ["reward", "--model", str(model), *[x for d in data for x in ("--data", str(d))], "--group-by-prompt",
            "--output-dir", str(out), "--epochs", "1", "--batch-size", "2", "--train-layers", "1", "--lr", "1e-2",
            "--norm-source", "pairs", "--precision", "fp32", "--device", "cpu", "--quiet", *more]


def test_two_rounds_label_reward_ppo(tiny_policy_dir, inputs, tmp_path):
    """docs/pipeline.md's two rounds on a tiny model: label -> reward -> ppo -> label the new policy ->
    reward --init-from on both pair files -> ppo from the last policy and critic, KL from the start."""
    def rows(path):
        return read(path / "metrics.jsonl")

    l1, l2 = tmp_path / "labels1", tmp_path / "labels2"
    assert main(label_argv(tiny_policy_dir, inputs, l1, "--judge", inputs["judge"])) == 0
    assert main(reward_argv(tiny_policy_dir, tmp_path / "rm1", [l1 / "pairs.jsonl"],
                            "--eval-data", str(l1 / "pairs.jsonl"))) == 0
    assert main(ppo_argv(tiny_policy_dir, tmp_path / "rm1", inputs["prompts"], tmp_path / "ppo1",
                         "--actor-lr", "1e-3")) == 0
    policy1 = tmp_path / "ppo1" / "policy"
    assert main(label_argv(policy1, inputs, l2, "--judge", inputs["judge"])) == 0
    assert read(l2 / "answers.jsonl")[0]["model"] == str(policy1)

    # round 2's reward model continues round 1's: before training it scores the held-out pairs exactly
    # as round 1's finished model did (its raw head, before the normalisation is fitted again)
    assert main(reward_argv(tiny_policy_dir, tmp_path / "rm2", [l1 / "pairs.jsonl", l2 / "pairs.jsonl"],
                            "--eval-data", str(l1 / "pairs.jsonl"), "--init-from", str(tmp_path / "rm1"))) == 0
    first, last = rows(tmp_path / "rm2")[0], rows(tmp_path / "rm1")[-1]
    assert first["epoch"] == 0 and first["eval_loss"] == pytest.approx(last["eval_loss"], abs=1e-5)
    fresh = tmp_path / "rm2_fresh"  # a new head on --model starts elsewhere
    assert main(reward_argv(tiny_policy_dir, fresh, [l1 / "pairs.jsonl"], "--eval-data", str(l1 / "pairs.jsonl"),
                            "--epochs", "1")) == 0
    assert rows(fresh)[0]["eval_loss"] != pytest.approx(last["eval_loss"], abs=1e-5)
    trained = len(read(l1 / "pairs.jsonl")) + len(read(l2 / "pairs.jsonl"))
    assert trained > len(read(l1 / "pairs.jsonl"))

    # round 2's PPO: policy and critic from round 1, the KL measured from the tiny SFT model (so it is
    # not 0 at the first rollout, as it is when the reference is round 1's policy itself)
    assert main(ppo_argv(policy1, tmp_path / "rm2", inputs["prompts"], tmp_path / "ppo2",
                         "--critic-model", str(tmp_path / "ppo1" / "critic"))) == 0
    assert main(ppo_argv(policy1, tmp_path / "rm2", inputs["prompts"], tmp_path / "ppo2_self",
                         "--ref-model", str(policy1))) == 0
    kl_sft, kl_self = rows(tmp_path / "ppo2")[0]["objective/kl"], rows(tmp_path / "ppo2_self")[0]["objective/kl"]
    assert abs(kl_self) < 1e-4 and abs(kl_sft) > 100 * max(abs(kl_self), 1e-6)  # k1 can be < 0 on samples
    assert (tmp_path / "ppo2" / "policy" / "model.safetensors").is_file()


def test_ctrl_c_while_sampling_stops_cleanly(tiny_policy_dir, tmp_path):
    """Ctrl-C as soon as the page is up, while the sampler thread loads the model and samples: the
    command waits for the batch in flight and exits 0 (the thread, killed inside torch at exit,
    used to abort the process with "terminate called without an active exception")."""
    import os
    import re
    import signal
    import subprocess
    import sys

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(24)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ppolm", "label", "--model", str(tiny_policy_dir), "--prompts",
                             str(prompts), "--output-dir", str(tmp_path / "lab"), "--port", "0", "--response-length",
                             "16", "--batch-size", "4", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert re.search(r"open http://", proc.stdout.readline())
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "terminate called" not in err and "Traceback" not in err, err
    assert "stopped: 0/24 prompts judged" in out
