"""A disaggregated-encoder proxy for the end-to-end suite, in the pattern of vLLM's example
(examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py, which is for reading, not in
the wheel): written here so the suite runs a proxy nobody has to fetch.

For a `POST /v1/chat/completions`, each image item of the request goes alone, in a chat request
with `max_tokens` 1, to an encoder server (`ec_producer`, `--mm-encoder-only`), round-robin over
the encoder servers across requests, all at once; once every one has answered, the whole request
goes to a prefill/decode server (`ec_consumer`; round-robin over several), streamed back when it
asked to be. An encoder server's answer may carry `ec_transfer_params` (vLLM's own connectors
pass a pull's address that way; ecd's passes nothing: the pool holds what the encoder saved),
which go on to prefill/decode. An encoder's failure fails the request (502, or the encoder's
status) before prefill/decode is asked. With no encoder server the proxy is a round-robin router
(the serving benchmark's, in front of `ec_both` engines). `GET /health` answers 200 once the
proxy serves (it does not ask its servers).

Run: `python tests/e2e/epd_proxy.py [--encoder URL ...] --prefill-decode URL [--prefill-decode
URL ...] --port PORT` (serving.Proxy starts it so in the suite).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

MEDIA = {"image_url"}  # the content items this proxy sends to an encoder (the suite sends images)


def media_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every image item of the request's messages, in order."""
    return [
        item
        for message in body.get("messages", [])
        if isinstance(message.get("content"), list)
        for item in message["content"]
        if item.get("type") in MEDIA
    ]


def make_app(encoders: list[str], prefill_decode: list[str]) -> FastAPI:
    app = FastAPI()
    # Round-robin, each advanced only between awaits: no lock needed.
    turn = itertools.cycle(encoders)
    decoder = itertools.cycle(prefill_decode)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None))

    async def encode(body: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
        request = {
            "model": body.get("model"),
            "messages": [{"role": "user", "content": [item]}],
            "max_tokens": 1,
            "stream": False,
        }
        answer = await client.post(f"{next(turn)}/v1/chat/completions", json=request)
        if answer.status_code != 200:
            raise HTTPException(answer.status_code, f"encoder request failed: {answer.text}")
        params: dict[str, Any] = answer.json().get("ec_transfer_params") or {}
        return params

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await request.json()
        try:
            items = media_items(body) if encoders else []  # no encoder: a router
            answers = await asyncio.gather(*(encode(body, item) for item in items))
        except httpx.HTTPError as e:
            raise HTTPException(502, f"encoder request failed: {e!r}") from e
        params = {key: value for answer in answers for key, value in answer.items()}
        if params:
            body = {**body, "ec_transfer_params": params}
        url = f"{next(decoder)}/v1/chat/completions"
        if not body.get("stream"):
            answer = await client.post(url, json=body)
            return Response(
                answer.content,
                status_code=answer.status_code,
                media_type=answer.headers.get("content-type"),
            )
        streamed = await client.send(client.build_request("POST", url, json=body), stream=True)
        chunks: AsyncIterator[bytes] = streamed.aiter_raw()
        return StreamingResponse(
            chunks,
            status_code=streamed.status_code,
            media_type=streamed.headers.get("content-type"),
            background=BackgroundTask(streamed.aclose),
        )

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--encoder", action="append", default=[], help="an encoder server's URL (none: a router)"
    )
    parser.add_argument(
        "--prefill-decode", action="append", required=True, help="a prefill/decode server's URL"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = make_app(
        [url.rstrip("/") for url in args.encoder], [url.rstrip("/") for url in args.prefill_decode]
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
