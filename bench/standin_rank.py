"""A fast stand-in for rank 0, so a benchmark measures the proxy in front of
it and not the model: readiness, drain, and chat completions answered at once
(whole, or streamed as --chunks SSE chunks). Runs as an agent profile; it
carries the generation marker like any rank; ranks other than 0 only wait
for their signal, as a trivial profile for the scale benchmark."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time

from aiohttp import web


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--meshd-generation", type=int, default=0)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--pace-ms", type=float, default=0.0, help="milliseconds between streamed chunks (0: back to "
                                                               "back); each chunk's text says when it was sent")
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args()
    if args.rank:
        signal.pause()
        return
    created = int(time.time())

    def chunk(i: int, finish: str | None) -> bytes:
        text = f"t{i} {time.time():.6f} " if args.pace_ms else f"t{i} "
        body = {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": created, "model": "standin",
                "choices": [{"index": 0, "delta": {} if finish else {"content": text}, "logprobs": None,
                             "finish_reason": finish}]}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    whole = json.dumps({"id": "chatcmpl-standin", "object": "chat.completion", "created": created,
                        "model": "standin", "choices": [{"index": 0, "message": {"role": "assistant",
                                                                                 "content": "ok", "refusal": None},
                                                         "logprobs": None, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=whole, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(args.chunks):
            if args.pace_ms and i:
                await asyncio.sleep(args.pace_ms / 1000)
            await resp.write(chunk(i, None))
        await resp.write(chunk(args.chunks, "stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def ready(request):
        return web.json_response({"ready": True, "generation": args.meshd_generation})

    async def drain(request):
        asyncio.get_running_loop().call_later(0.05, os._exit, 0)
        return web.json_response({"draining": True}, status=202)

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "standin", "object": "model", "created": created,
                                                               "owned_by": "meshd"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/internal/ready", ready)
    app.router.add_post("/internal/drain", drain)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
