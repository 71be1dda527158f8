"""``ppolm serve-rm``: a reward model served over HTTP, in the protocol ``ppolm ppo --reward-url`` speaks.

It serves any reward model ppolm loads (``ppolm reward``'s, or a one-label sequence-classification
model) with its gain/bias normalisation, through :meth:`ppolm.rewards.RewardModel.score_texts`,
so a text scores over HTTP what it scores in-process::

    POST /get_reward   {"query": [text, ...], ...}  ->  {"rewards": [number, ...]}
    GET  /health       {"status": "ok", "model": ..., "requests": n, "forward_batches": m}

Other keys of the request (``prompts``, ``labels``) are accepted and ignored: the model reads the
whole prompt+response text. Requests that arrive within ``--batch-wait-ms`` of each other are
scored together, in forward passes of up to ``--batch-size`` texts (one pass at a time, off the
event loop, so requests keep arriving meanwhile). A malformed request gets HTTP 400 and
``{"error": "..."}``; a failing model, HTTP 500 alike. The server is starlette on uvicorn. It
listens on 127.0.0.1 by default: it has no authentication, so put it behind one before listening
on other addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from ppolm.config_sections import ModelLoading
from ppolm.errors import PPOLMError
from ppolm.rewards import RewardModel, reward_model_dir
from ppolm.runtime import dtype_of, resolve_device, resolve_precision


@dataclass
class ServeRMConfig(ModelLoading):
    """Options of ``ppolm serve-rm``."""

    reward_model: str | None = None
    """Reward model directory to serve (from `ppolm reward`, or any one-label sequence-classification model)."""
    host: str = "127.0.0.1"
    """Address to listen on; 127.0.0.1 = this machine only (the service has no authentication)."""
    port: int = 5000
    """Port to listen on; 0 picks a free one (printed at start)."""
    batch_size: int = 16
    """Texts per forward pass; requests that arrive together are scored in passes of up to this many."""
    batch_wait_ms: float = 5.0
    """Milliseconds a request waits for others to join its forward pass."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """The model's dtype: bf16, fp32, or auto (bf16 where native). Serve in the precision the trainer would score in."""

    def validate(self) -> None:
        if self.reward_model is None:
            raise PPOLMError("serve-rm needs --reward-model DIR (a reward model from `ppolm reward`)")
        if not 0 <= self.port <= 65535:
            raise PPOLMError(f"--port must be in 0..65535 (0 = a free port); got {self.port}")
        if self.batch_size < 1:
            raise PPOLMError(f"--batch-size must be >= 1; got {self.batch_size}")
        if not 0 <= self.batch_wait_ms <= 10_000:
            raise PPOLMError(f"--batch-wait-ms must be in [0, 10000]; got {self.batch_wait_ms}")


class Batcher:
    """Gathers the texts of requests that arrive within ``wait_s`` of the first one (up to
    ``batch_size`` texts) and scores them in one call of ``score``, run on one worker thread."""

    def __init__(self, score: Callable[[list[str]], list[float]], batch_size: int, wait_s: float):
        self.score, self.batch_size, self.wait_s = score, batch_size, wait_s
        self.queue: asyncio.Queue[tuple[list[str], asyncio.Future]] | None = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ppolm-rm")
        self.requests = 0
        self.passes = 0
        """Calls of ``score`` so far (each is one or more forward passes of up to batch_size texts)."""

    async def submit(self, texts: list[str]) -> list[float]:
        assert self.queue is not None, "the batcher runs inside the app's lifespan"
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.requests += 1
        await self.queue.put((texts, done))
        return await done

    async def run(self) -> None:
        self.queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            n, deadline = len(items[0][0]), loop.time() + self.wait_s
            while n < self.batch_size and (left := deadline - loop.time()) > 0:
                try:
                    items.append(await asyncio.wait_for(self.queue.get(), left))
                except TimeoutError:
                    break
                n += len(items[-1][0])
            texts = [t for ts, _ in items for t in ts]
            try:
                scores = await loop.run_in_executor(self.pool, self.score, texts)
            except Exception as e:  # the requests get HTTP 500 with the reason
                for _, done in items:
                    if not done.done():
                        done.set_exception(e)
                continue
            self.passes += 1
            i = 0
            for ts, done in items:
                if not done.done():  # (a client that went away cancelled its future)
                    done.set_result(scores[i:i + len(ts)])
                i += len(ts)


def build_app(score: Callable[[list[str]], list[float]], name: str, batch_size: int = 16,
              batch_wait_ms: float = 5.0) -> Any:
    """The starlette app: POST /get_reward scores ``query`` with ``score`` (a batch of texts -> one
    number each), GET /health reports the model and the counts."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    batcher = Batcher(score, batch_size, batch_wait_ms / 1000)

    def answer(content: Any, status: int = 200) -> Response:
        # NaN stays NaN (as Python's json writes it): the client's non-finite guard deals with it
        return Response(json.dumps(content, allow_nan=True), status_code=status, media_type="application/json")

    async def get_reward(request: Request) -> Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return answer({"error": "the body is not JSON; send {\"query\": [text, ...]}"}, 400)
        query = body.get("query") if isinstance(body, dict) else None
        if not isinstance(query, list) or not all(isinstance(q, str) for q in query):
            return answer({"error": "the body needs \"query\": a list of prompt+response strings"}, 400)
        if not query:
            return answer({"rewards": []})
        empty = next((i for i, q in enumerate(query) if not q), None)
        if empty is not None:  # no token to score (alone it cannot be scored; in a batch it would score padding)
            return answer({"error": f"query {empty} is an empty string; send prompt+response texts"}, 400)
        try:
            rewards = await batcher.submit(query)
        except Exception as e:
            return answer({"error": f"scoring failed: {type(e).__name__}: {e}"}, 500)
        return answer({"rewards": rewards})

    async def health(request: Request) -> Response:
        return answer({"status": "ok", "model": name, "requests": batcher.requests,
                       "forward_batches": batcher.passes})

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        return answer({"error": f"{getattr(exc, 'detail', 'error')}; use POST /get_reward or GET /health"}, status)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):  # the batcher lives as long as the server
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher.pool.shutdown(wait=False)

    app = Starlette(routes=[Route("/get_reward", get_reward, methods=["POST"]),
                            Route("/health", health, methods=["GET"])],
                    exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    app.state.batcher = batcher
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), so the port is known before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PPOLMError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port (0 picks a free "
                         "one) or --host") from None
    sock.listen(128)
    return sock


class RunningServer:
    """uvicorn serving ``app`` on an already bound socket: :meth:`run` blocks (Ctrl-C stops it);
    :meth:`start` runs it on a daemon thread until :meth:`stop`."""

    def __init__(self, app: Any, sock: socket.socket):
        import uvicorn

        self.app, self.sock = app, sock
        host, self.port = sock.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self, timeout: float = 30.0) -> RunningServer:
        self.thread = threading.Thread(target=self.run, name="ppolm-serve-rm", daemon=True)
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise PPOLMError(f"the reward server on {self.url} did not start within {timeout:g} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def load(cfg: ServeRMConfig) -> tuple[Any, Callable[[list[str]], list[float]]]:
    """The reward model of ``cfg`` and its scoring function (texts -> normalised scores)."""
    cfg.validate()
    reward_model_dir(cfg.reward_model, allow_pickle=cfg.allow_pickle)  # type: ignore[arg-type]
    device = resolve_device(cfg.device)
    dtype = dtype_of(resolve_precision(cfg.precision, device))
    rm = RewardModel(cfg.reward_model, dtype=dtype, device=device,  # type: ignore[arg-type]
                     trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
    return rm, lambda texts: rm.score_texts(texts, cfg.batch_size).tolist()


def start(cfg: ServeRMConfig) -> RunningServer:
    """Load the reward model and serve it on a background thread (from Python: tests, notebooks);
    ``.url``, ``.port``, ``.stop()``."""
    rm, score = load(cfg)
    sock = bind(cfg.host, cfg.port)
    return RunningServer(build_app(score, rm.name, cfg.batch_size, cfg.batch_wait_ms), sock).start()


def run(cfg: ServeRMConfig) -> int:
    """``ppolm serve-rm``: serve until Ctrl-C (or SIGTERM)."""
    cfg.validate()
    reward_model_dir(cfg.reward_model, allow_pickle=cfg.allow_pickle)  # type: ignore[arg-type]
    sock = bind(cfg.host, cfg.port)  # a taken port fails before the model loads
    try:
        rm, score = load(cfg)
    except BaseException:
        sock.close()
        raise
    server = RunningServer(build_app(score, rm.name, cfg.batch_size, cfg.batch_wait_ms), sock)
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {cfg.host} without authentication: anyone who reaches this port can use the "
              "model", file=sys.stderr)
    print(f"serving reward model {cfg.reward_model} at {server.url}/get_reward (health: {server.url}/health); "
          "Ctrl-C stops", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    print("reward server stopped", flush=True)
    return 0
