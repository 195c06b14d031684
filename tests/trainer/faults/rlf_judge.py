"""A local HTTP judge for the reward-endpoint tests: a real stdlib HTTP server on 127.0.0.1 in a
thread of the test, answering each POST as the test's function says (a score, a chat completion,
or a fault: a hang past the client's timeout, a 5xx, a garbage body, a reply without a score)."""
import json
import random
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# (status, body text, seconds to wait before answering)
Answer = tuple[int, str, float]


class LocalJudge:
    """`answer(request body) -> Answer` serves every POST; `requests` keeps the bodies, `max_in_flight`
    the most requests served at once."""

    def __init__(self, answer: Callable[[dict], Answer]) -> None:
        self.answer, self.requests, self.in_flight, self.max_in_flight = answer, [], 0, 0
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.requests.append((time.monotonic(), self.path, dict(self.headers), body))
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                try:
                    status, text, delay = judge.answer(body)
                    time.sleep(delay)
                    data = text.encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout): what a real server sees too
                finally:
                    with judge.lock:
                        judge.in_flight -= 1

            def log_message(self, *args):
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/chat/completions"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "LocalJudge":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    # The stdlib's backlog of 5 drops the connections of a burst (a step's 64 samples at once):
    # their clients would retry the connect a second later and time out, faults of the test server.
    request_queue_size = 256


def chat_completion(content: str) -> str:
    return json.dumps({"id": "x", "object": "chat.completion",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop"}]})


def faulty_answer(fault: str, hang_s: float) -> Answer | None:
    """A chat judge's answer for `fault` (hang | 500 | garbage | unparsed); None for any other."""
    return {"hang": (200, chat_completion("<score>1</score>"), hang_s),
            "500": (500, "internal error", 0.0),
            "garbage": (200, "<html>upstream hiccup</html>", 0.0),
            "unparsed": (200, chat_completion("I cannot decide."), 0.0)}.get(fault)


class FaultyChatJudge:
    """A chat judge that fails a share of requests at random (seeded): hangs `hang_s`, answers 500,
    garbage, or a reply with no score; else a reply "#<n> ... <score>x</score>" whose number and
    score it remembers in `scored` (n -> x), so a test can check a stored reply is one it sent."""

    FAULTS = ("hang", "500", "garbage", "unparsed", "ok", "ok", "ok", "ok")

    def __init__(self, hang_s: float, seed: int = 0) -> None:
        self.hang_s, self.rng, self.scored, self.faults = hang_s, random.Random(seed), {}, {}
        self.lock = threading.Lock()

    def __call__(self, body: dict) -> Answer:
        with self.lock:
            fault = self.rng.choice(self.FAULTS)
            self.faults[fault] = self.faults.get(fault, 0) + 1
            n = len(self.scored)
            score = self.rng.choice((0.0, 0.25, 0.5, 0.75, 1.0))
            if fault == "ok":
                self.scored[n] = score
        return faulty_answer(fault, self.hang_s) or (200, chat_completion(f"#{n} judged. <score>{score}</score>"), 0.0)
