"""A user's own tensor-parallel OpenAI server, as the field writes theirs: omlx set up by hand, the model
loaded and sharded with mlx-lm, every rank stepping mlx-lm's BatchGenerator together; rank 0 serves
GET /health, GET /v1/models and POST /v1/chat/completions (greedy, whole answers) and hands each request to
the others with a broadcast. It knows nothing of meshd: no status file, no drain; `--meshd-generation` is
only the marker meshd's agent finds it by. tests/agent/test_own_driver.py runs it under the agents'
`own-driver` profile."""

import argparse
import json
import os
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import mlx.core as mx
import mlx_lm.utils
from mlx_lm.generate import BatchGenerator, generation_stream
from mlx_lm.utils import load_tokenizer

from omlx.patches.deepseek_v4 import apply_deepseek_v4_patch

IDLE = 0.05  # seconds rank 0 waits for a request before the ranks meet again


def serve(args, tokenizer, inbox: queue.Queue) -> None:
    secret = os.environ.get("MESHD_RANK_SECRET", "")

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _allowed(self) -> bool:
            if secret and self.headers.get("Authorization") != f"Bearer {secret}":
                self._send(401, {"error": {"message": "bad token", "type": "invalid_request_error"}})
                return False
            return True

        def do_GET(self):
            if not self._allowed():
                return
            if self.path == "/health":
                self._send(200, {"ok": True})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": args.model_name, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})

        def do_POST(self):
            if not self._allowed():
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/v1/chat/completions" or body.get("stream"):
                self._send(400, {"error": {"message": "only whole chat completions", "type": "invalid_request_error"}})
                return
            prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
            done: queue.Queue = queue.Queue()
            inbox.put((prompt, int(body.get("max_tokens") or args.max_tokens), done))
            tokens, reason = done.get()
            self._send(200, {"id": f"own-{time.time_ns()}", "object": "chat.completion", "created": int(time.time()),
                             "model": args.model_name,
                             "choices": [{"index": 0, "finish_reason": reason,
                                          "message": {"role": "assistant", "content": tokenizer.decode(tokens)}}],
                             "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                                       "total_tokens": len(prompt) + len(tokens)}})

        def log_message(self, *a):
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


def broadcast(group, values: list[int] | None, length: int) -> list[int]:
    """Rank 0's `values` (`length` of them) on every rank: on the generator's stream, behind the collectives of
    the step it may still be computing, so every rank meets them in the same order."""
    with mx.stream(generation_stream):
        return mx.distributed.all_sum(mx.array(values or [0] * length, dtype=mx.int32), group=group).tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--meshd-generation", default="")
    args = p.parse_args()
    path = Path(args.model)
    args.model_name = path.name
    group = mx.distributed.init(backend=os.environ.get("MESHD_BACKEND", "any"))
    apply_deepseek_v4_patch()  # omlx's loader reads the checkpoint; MTP left off: plain batched decoding
    model, config = mlx_lm.utils.load_model(path)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    if group.size() > 1:
        model.shard(group)
    mx.eval(model.parameters())
    inbox: queue.Queue = queue.Queue()
    if group.rank() == 0:
        threading.Thread(target=serve, args=(args, tokenizer, inbox), daemon=True).start()
    print(f"rank {group.rank()} of {group.size()} loaded", flush=True)
    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids])
    answers: dict[int, tuple[list[int], queue.Queue]] = {}
    while True:
        new = None
        if group.rank() == 0:
            try:
                new = inbox.get(timeout=0 if answers else IDLE)
            except queue.Empty:
                pass
        length, max_tokens = broadcast(group, [len(new[0]), new[1]] if new else None, 2)
        if length:
            (uid,) = gen.insert([broadcast(group, new[0] if new else None, length)], max_tokens=[max_tokens])
            answers[uid] = ([], new[2] if new else None)
        if not answers:
            continue
        for r in gen.next()[1]:
            tokens, done = answers[r.uid]
            if r.finish_reason != "stop":
                tokens.append(r.token)
            if r.finish_reason is not None:
                del answers[r.uid]
                if done is not None:
                    done.put((tokens, r.finish_reason))


if __name__ == "__main__":
    main()
