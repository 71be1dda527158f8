"""``ppolm label``: rank a policy's answers on a local web page; the rankings become preference pairs.

The first step of RLHF's reward-model stage (Ouyang et al. 2022, section 3.4): a person sees a prompt
and K answers sampled from the policy, and ranks them. Each ranking of K answers gives up to
C(K, 2) chosen/rejected pairs, which ``ppolm reward --group-by-prompt`` trains on as one item per
prompt, as InstructGPT did. Rounds (Llama 2, Anthropic's HH) repeat this on the newest policy:
docs/pipeline.md.

The files it writes in ``--output-dir`` (settings, sampled answers, judgements, pairs), and how
each change reaches the disk: ppolm/label_store.py.

Safe by default: the server listens on 127.0.0.1; another ``--host`` needs an access token that
every request carries (``?token=`` or the ``X-PPOLM-Token`` header). Prompts and answers reach the
page as JSON and are shown with ``textContent``, and the page's Content-Security-Policy lets only its
own script run.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
import random
import re
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppolm import models
from ppolm import rollout as ro
from ppolm.config_sections import ModelLoading
from ppolm.data import load_prompts
from ppolm.errors import PPOLMError
from ppolm.judge import load_judge
from ppolm.label_store import BadRequest, LabelStore, ranking_from_labels
from ppolm.runtime import dtype_of, resolve_device, resolve_precision
from ppolm.serve_rm import bind

PAGE = Path(__file__).parent / "label_page.html"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_BODY = 64 * 1024
"""Largest request body accepted (a judgement is a few hundred bytes)."""


@dataclass
class LabelConfig(ModelLoading):
    """Everything ``ppolm label`` needs; ``run(config.build(LabelConfig, {...}))``."""

    model: str = "smollm2-135m-instruct"
    """Policy whose answers are ranked: a model directory (a `ppolm ppo` run's policy/ included), a .gguf or an embedded name."""
    prompts: str | None = None
    """Prompts file (.jsonl/.json/.txt/.parquet/.csv with 'prompt' or 'messages'); default: the built-in prompts."""
    k: int = 4
    """Answers sampled per prompt and ranked together (InstructGPT showed 4 to 9)."""
    output_dir: str = "runs/label"
    """Where label.json, answers.jsonl, judgements.jsonl and pairs.jsonl go; rerun with it to continue."""
    host: str = "127.0.0.1"
    """Address to listen on; any other than 127.0.0.1/localhost/::1 requires an access token."""
    port: int = 8765
    """Port to listen on; 0 = any free port (printed)."""
    token_env: str | None = None
    """Environment variable holding the access token; default: a new random token, printed with the page's address."""
    judge: str | None = None
    """Label without a person: a judge 'file.py:function' (ppolm/judge.py conventions) ranks every answer, then exit."""
    judge_temperature: float = 0.0
    """Bradley-Terry label noise of --judge (0 = its labels follow its scores)."""
    response_length: int = 48
    """Maximum number of new tokens per answer."""
    temperature: float = 1.0
    """Sampling temperature (as `ppolm ppo --temperature`)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to text prompts, as `ppolm ppo` does."""
    batch_size: int = 8
    """Prompts sampled together (each with its K answers)."""
    seed: int = 0
    """Random seed of the sampling (each batch's seed follows from it and the batch's first prompt)."""

    def validate(self) -> None:
        if self.k < 2:
            raise PPOLMError(f"--k must be at least 2 (a ranking needs two answers); got {self.k}")
        if self.k > 9:
            raise PPOLMError(f"--k must be at most 9 (the page ranks with the keys 1-9); got {self.k}")
        if not 0 <= self.port <= 65535:
            raise PPOLMError(f"--port must be in 0..65535; got {self.port}")
        if self.response_length < 1 or self.batch_size < 1:
            raise PPOLMError("--response-length and --batch-size must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise PPOLMError(f"--temperature must be a finite number > 0; got {self.temperature}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise PPOLMError("--top-p must be in (0, 1] and --top-k >= 0")
        if not (math.isfinite(self.judge_temperature) and self.judge_temperature >= 0):
            raise PPOLMError(f"--judge-temperature must be a finite number >= 0; got {self.judge_temperature}")

    def sampling(self) -> dict[str, Any]:
        return {"response_length": self.response_length, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "chat_template": self.chat_template, "seed": self.seed}


# ------------------------------------------------------------------------------------ sampling

class Sampler:
    """Samples K answers for every prompt that has none yet, in order, appending each prompt's
    answers as soon as its batch is done: run in a thread ahead of the labeller, or in place."""

    def __init__(self, cfg: LabelConfig, store: LabelStore, tok: Any, ids: list[list[int]]):
        self.cfg, self.store, self.tok, self.ids = cfg, store, tok, ids
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            self._run()
        except PPOLMError as e:
            self.store.error = str(e)
            print(f"error: {e}", file=sys.stderr, flush=True)
        except Exception as e:  # the page and the terminal say why sampling stopped
            self.store.error = f"sampling stopped: {type(e).__name__}: {e}"
            print(f"error: {self.store.error}", file=sys.stderr, flush=True)
            raise
        finally:
            self.store.sampling_done.set()

    def _run(self) -> None:
        todo = self.store.missing()
        if not todo:
            return
        cfg, tok = self.cfg, self.tok
        device = resolve_device(cfg.device)
        precision = resolve_precision(cfg.precision, device)
        policy = models.load_causal_lm(
            cfg.model, dtype=dtype_of(precision), device=device, tokenizer=tok,
            trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
        t0, k, n = time.perf_counter(), cfg.k, len(todo)
        for b in range(0, n, cfg.batch_size):
            if self.stop.is_set():
                return
            chunk = todo[b:b + cfg.batch_size]
            torch.manual_seed(cfg.seed * 1_000_003 + chunk[0])  # a restart samples a batch as before
            jobs = [self.ids[i] for i in chunk for _ in range(k)]
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                roll = ro.generate(policy, jobs, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                                   max_new_tokens=cfg.response_length, temperature=cfg.temperature,
                                   top_p=cfg.top_p, top_k=cfg.top_k)
            texts = tok.batch_decode(roll.response * roll.response_mask, skip_special_tokens=True)
            for j, i in enumerate(chunk):
                self.store.add_answers(i, texts[j * k:(j + 1) * k])
            done, el = b + len(chunk), time.perf_counter() - t0
            print(f"sampled {done}/{n} prompts ({k} answers each; {el:.0f}s, eta {el / done * (n - done):.0f}s)",
                  file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ judge

def judge_all(cfg: LabelConfig, store: LabelStore) -> int:
    """Rank every unjudged prompt with ``--judge``: all C(K, 2) pairs labelled, answers ordered by
    their wins (:func:`ranking_from_labels`), each ranking submitted as the page submits one."""
    judge = load_judge(cfg.judge, cfg.judge_temperature)  # type: ignore[arg-type]
    rng = random.Random(cfg.seed)
    k = cfg.k
    pairs = [(a, b) for a in range(k) for b in range(a + 1, k)]
    n = 0
    while (i := store.next_index()) is not None:
        row = store.answers[i]
        cols = {c: [v] * len(pairs) for c, v in store.columns[i].items()} or None
        labels = judge.label([row["prompt"]] * len(pairs), [row["answers"][a] for a, _ in pairs],
                             [row["answers"][b] for _, b in pairs], rng, cols)
        store.submit({"index": i, "ranking": ranking_from_labels(k, pairs, labels)}, labeller=f"judge:{cfg.judge}")
        n += 1
    return n


# ------------------------------------------------------------------------------------ server

def page_and_csp() -> tuple[bytes, str]:
    """The page, and a Content-Security-Policy that lets only its own inline script run (by hash)."""
    html = PAGE.read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    hashes = " ".join("'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
                      for s in scripts)
    csp = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
           "img-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html.encode("utf-8"), csp


def make_app(store: LabelStore, token: str | None, allowed_hosts: tuple[str, ...] | None = None) -> Any:
    """The Starlette app: GET / (the page), GET /api/state, POST /api/judgement, POST /api/undo.

    ``token``: every request must carry it (``?token=`` or header ``X-PPOLM-Token``), compared in
    constant time. ``allowed_hosts``: the Host header must name one of them (against DNS
    rebinding of a local server). POSTs must be JSON from the page's own origin (no cross-site
    form can post one)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    page, csp = page_and_csp()

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers={"Cache-Control": "no-store"})

    class Guard:
        """ASGI middleware: host, token, origin and body-size checks before any route runs."""

        def __init__(self, app: Any):
            self.app = app

        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            req = Request(scope)
            refusal = self.refuse(req)
            if refusal is not None:
                return await refusal(scope, receive, send)
            return await self.app(scope, receive, send)

        @staticmethod
        def refuse(req: Request) -> JSONResponse | None:
            host = req.headers.get("host", "")
            if allowed_hosts is not None:
                name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
                if name.strip("[]") not in allowed_hosts:
                    return error(400, "unexpected Host header; open the address the server printed")
            if token is not None:
                given = req.headers.get("x-ppolm-token") or req.query_params.get("token") or ""
                if not hmac.compare_digest(given.encode("utf-8", "replace"), token.encode("utf-8")):
                    return error(401, "missing or wrong access token; open the address the server printed")
            if req.method == "POST":
                if req.headers.get("content-type", "").split(";")[0].strip() != "application/json":
                    return error(415, "send the request body as application/json")
                origin = req.headers.get("origin")
                if origin is not None and origin.split("://", 1)[-1] != host:
                    return error(403, "cross-origin requests are refused")
                size = req.headers.get("content-length")
                if size is None or not size.isdigit() or int(size) > MAX_BODY:
                    return error(413, f"the request body must state its length and be at most {MAX_BODY} bytes")
            return None

    async def body_of(req: Request) -> Any:
        raw = await req.body()
        if len(raw) > MAX_BODY:
            raise BadRequest(413, f"the request body must be at most {MAX_BODY} bytes")
        try:
            return json.loads(raw.decode("utf-8")) if raw.strip() else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise BadRequest(400, "the request body is not valid JSON") from None

    async def index(req: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": csp, "Cache-Control": "no-store",
                                 "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})

    async def state(req: Request) -> Response:
        return JSONResponse(store.state(), headers={"Cache-Control": "no-store"})

    async def judgement(req: Request) -> Response:
        try:
            row = store.submit(await body_of(req))
        except BadRequest as e:
            return error(e.status, str(e))
        return JSONResponse({"saved": row["id"], **store.state()})

    async def undo(req: Request) -> Response:
        try:
            i = store.undo(await body_of(req))
        except BadRequest as e:
            return error(e.status, str(e))
        return JSONResponse({"undone": i, **store.state(i)})

    async def http_error(req: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error; see the server's terminal"
        return error(status, str(detail))

    routes = [Route("/", index), Route("/api/state", state), Route("/api/judgement", judgement, methods=["POST"]),
              Route("/api/undo", undo, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: http_error})
    app.add_middleware(Guard)
    return app


def access_token(cfg: LabelConfig) -> str | None:
    """The token requests must carry: from --token-env, or a new one when --host is not local; None
    on a local host without --token-env."""
    if cfg.token_env:
        value = os.environ.get(cfg.token_env, "")
        if len(value) < 16:
            raise PPOLMError(f"--token-env {cfg.token_env}: that environment variable must hold a token of at "
                             "least 16 characters (e.g. from `python -c 'import secrets; print(secrets.token_urlsafe())'`)")
        return value
    return None if cfg.host in LOCAL_HOSTS else secrets.token_urlsafe(24)


# ------------------------------------------------------------------------------------ command

def settings(cfg: LabelConfig, n_prompts: int) -> dict[str, Any]:
    """What label.json records, and a rerun must match: the model, prompts, K and sampling."""
    return {"model": cfg.model, "prompts": str(Path(cfg.prompts).resolve()) if cfg.prompts else "built-in",
            "n_prompts": n_prompts, "k": cfg.k, "sampling": cfg.sampling()}


def prepare(cfg: LabelConfig) -> tuple[LabelStore, Sampler]:
    """Read the prompts, open (or continue) the output directory, and set up the sampler."""
    cfg.validate()
    if cfg.judge:
        load_judge(cfg.judge, cfg.judge_temperature)  # a bad spec fails before any sampling
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise PPOLMError(f"--output-dir {out} is a file; choose a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "label.json").is_file():
        raise PPOLMError(f"--output-dir {out} holds other files; choose a new or empty directory")
    tok = models.load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
    prompts = load_prompts(cfg.prompts, tok, chat_template=cfg.chat_template)
    raws = [p.raw for p in prompts]
    store = LabelStore(out, settings(cfg, len(raws)), raws, [p.extra for p in prompts])
    return store, Sampler(cfg, store, tok, [p.ids for p in prompts])


def run(cfg: LabelConfig) -> int:
    store, sampler = prepare(cfg)
    out = Path(cfg.output_dir)
    if cfg.judge:
        sampler.run()
        if store.error:
            raise PPOLMError(store.error)
        n = judge_all(cfg, store)
        s = store.state()
        print(f"done: the judge ranked {n} prompts ({s['done']}/{s['total']} judged); {s['pairs']} pairs in "
              f"{out / 'pairs.jsonl'}; train on them with `ppolm reward --data {out / 'pairs.jsonl'} "
              "--group-by-prompt`")
        return 0

    import uvicorn

    token = access_token(cfg)
    sock = bind(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    local = cfg.host in LOCAL_HOSTS
    app = make_app(store, token, LOCAL_HOSTS if local else None)
    thread = threading.Thread(target=sampler.run, name="ppolm-label-sampler", daemon=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))

    def on_ctrl_c(signum: int, frame: Any) -> None:
        # Ctrl-C before uvicorn takes the signal over (or after it gives it back) asks the server to
        # stop; while it serves, uvicorn's own handler does the same. A KeyboardInterrupt raised at
        # a random point of its start-up could leave it serving.
        server.should_exit = True

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    thread.start()
    shown = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    try:
        s = store.state()
        print(f"labelling {s['total']} prompts, {cfg.k} answers each ({s['done']} judged, {s['sampled']} sampled so "
              f"far); open {url}", flush=True)
        if not local:
            print(f"listening on {cfg.host}: every request must carry the access token", flush=True)
        if not server.should_exit:
            server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGINT, previous)
        sampler.stop.set()
        sock.close()
    # The sampler stops between batches. Left running, it would be killed inside torch when Python
    # exits, which aborts the process ("terminate called without an active exception").
    if thread.is_alive():
        print("finishing the batch of answers being sampled (Ctrl-C again to quit at once)", file=sys.stderr,
              flush=True)
        try:
            thread.join()
        except KeyboardInterrupt:  # every judgement is on disk; the unfinished batch is sampled again next time
            s = store.state()
            print(f"stopped: {s['done']}/{s['total']} prompts judged, {s['pairs']} pairs in {out / 'pairs.jsonl'}; "
                  "run the same command to continue", flush=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
    s = store.state()
    print(f"stopped: {s['done']}/{s['total']} prompts judged, {s['pairs']} pairs in {out / 'pairs.jsonl'}; "
          "run the same command to continue", flush=True)
    return 0
