"""The remote reward endpoint (`reward.remote`): each sample's model score from an HTTP server
(a judge behind OpenAI-compatible chat completions, or a plain score service), requests in flight
capped, retried with backoff; a sample whose request fails for good gets `reward.model.on_error`."""
import asyncio
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfactory_megatron.registry import Registry
from rlfactory_megatron.rewards.custom import RewardConfigError
from rlfactory_megatron.rewards.judge import JudgePrompt, ReplyNotParsed, reply_parser
from rlfactory_megatron.rewards.records import RewardSample

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

# Statuses worth another try: the server is overloaded or failing now, not refusing the request.
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class GarbageReply(ValueError):
    """The endpoint answered, but not with what its protocol promises (not JSON, a field missing)."""


class _Retried(Exception):
    """An HTTP status worth another try."""


class _Final(Exception):
    """An HTTP status that another try would not change (a 4xx: the request is wrong)."""


@dataclass
class ModelScore:
    """One sample's model score and how it was got; `error` set: the score is reward.model.on_error."""

    score: float
    reply: str | None = None  # the judge's text (chat), kept for reading (`rlf-cache show`)
    error: str | None = None
    parse_failed: bool = False  # the reply came, but held no score
    latency_s: float = 0.0  # from the first request to the outcome, retries and backoff included
    retries: int = 0
    cached: bool = False  # a judge served by our engines: the reply came from the cache, no engine call
    wait_s: float | None = None  # a served judge: how long after its phase's last trajectory ended the outcome came


@dataclass
class RemoteRewardSpec:
    """The `reward.remote` and `reward.model` settings, as the reward workers need them (it pickles)."""

    url: str
    protocol: str
    served_model: str | None
    api_key_env: str | None
    timeout_s: float
    max_retries: int
    backoff_s: float
    max_concurrency: int
    template: str | None
    parser: str
    max_tokens: int
    temperature: float
    on_error: float

    @classmethod
    def from_config(cls, reward) -> "RemoteRewardSpec | None":
        """From the `reward` config section; None when `reward.remote.url` is unset."""
        remote, model = reward.remote, reward.model
        if remote.url is None:
            if model.template is not None and model.kind is None:
                raise RewardConfigError("reward.model.template: is set, but no model reward reads it; set "
                                        "reward.remote.url (with reward.remote.protocol=chat), or reward.model.kind "
                                        "and path (a judge on our engines), or drop the template")
            return None
        return cls(remote.url, remote.protocol, remote.served_model, remote.api_key_env, remote.timeout_s,
                   remote.max_retries, remote.backoff_s, remote.max_concurrency, model.template, model.parser,
                   model.max_tokens, model.temperature, model.on_error)

    def budget_s(self, num_samples: int) -> float:
        """The longest `num_samples` samples can take: every request timing out and retried."""
        backoff = sum(self.backoff_s * 2**attempt for attempt in range(self.max_retries))
        waves = -(-num_samples // self.max_concurrency)
        return waves * ((self.max_retries + 1) * self.timeout_s + backoff)


class ScoreProtocol:
    """POST {"prompt", "response", "label"} and read {"score": float} (slime's --rm-url)."""

    def __init__(self, spec: RemoteRewardSpec) -> None:
        self.spec = spec

    def body(self, sample: RewardSample) -> dict:
        return {"prompt": sample.prompt, "response": sample.response, "label": sample.ground_truth}

    def read(self, payload: object) -> tuple[float, str | None]:
        """(score, reply text); GarbageReply when `payload` is not {"score": <finite number>}."""
        try:
            score = float(payload["score"])
        except (TypeError, KeyError, ValueError):
            raise GarbageReply(f'expected {{"score": <number>}}, got {json.dumps(payload)[:120]}') from None
        if not math.isfinite(score):
            raise GarbageReply(f"the score {score} is not finite")
        return score, None


class ChatProtocol:
    """OpenAI-compatible chat completions: the sample rendered by `reward.model.template`, the
    reply's text read by `reward.model.parser`."""

    def __init__(self, spec: RemoteRewardSpec) -> None:
        self.spec = spec
        self.prompt = JudgePrompt.from_config(spec.template)
        self.parse = reply_parser(spec.parser)

    def body(self, sample: RewardSample) -> dict:
        body = {"messages": self.prompt.messages(sample), "max_tokens": self.spec.max_tokens,
                "temperature": self.spec.temperature}
        if self.spec.served_model is not None:
            body["model"] = self.spec.served_model
        return body

    def read(self, payload: object) -> tuple[float, str | None]:
        """(score, reply text); GarbageReply when `payload` is no chat completion, ReplyNotParsed
        (with the text) when the text holds no score."""
        try:
            reply = payload["choices"][0]["message"]["content"]
        except (TypeError, KeyError, IndexError):
            raise GarbageReply(f"expected a chat completion, got {json.dumps(payload)[:120]}") from None
        if not isinstance(reply, str):
            raise GarbageReply(f"the completion's content is {type(reply).__name__}, not text")
        try:
            return self.parse(reply), reply
        except ReplyNotParsed as exc:
            raise ReplyNotParsed(str(exc), reply) from None


PROTOCOLS: Registry[type] = Registry("reward.remote protocol")
PROTOCOLS.register("chat", ChatProtocol)
PROTOCOLS.register("score", ScoreProtocol)


def check_remote(spec: RemoteRewardSpec) -> None:
    """Everything about `spec` that can be known without a request: starts nothing."""
    if not spec.url.startswith(("http://", "https://")):
        raise RewardConfigError(f"reward.remote.url: {spec.url!r} is no http(s) URL; give e.g. http://host:8000/score")
    if spec.protocol not in PROTOCOLS:
        raise RewardConfigError(f"reward.remote.protocol: unknown {spec.protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    if spec.protocol != "chat" and spec.template is not None:
        raise RewardConfigError(f"reward.model.template: only the chat protocol sends a prompt, and "
                                f"reward.remote.protocol={spec.protocol}; set it to chat or drop the template")
    if spec.api_key_env is not None and spec.api_key_env not in os.environ:
        raise RewardConfigError(f"reward.remote.api_key_env: the environment variable {spec.api_key_env} is not set; "
                                "export it (or set the key to null for no Authorization header)")
    if not math.isfinite(spec.on_error):
        raise RewardConfigError(f"reward.model.on_error: must be a finite number, got {spec.on_error}")
    PROTOCOLS.get(spec.protocol)(spec)  # the template and the parser (chat), loaded and checked


class RemoteReward:
    """Scores samples through the endpoint; one client session per call, at most
    `max_concurrency` requests in flight."""

    def __init__(self, spec: RemoteRewardSpec) -> None:
        check_remote(spec)
        self.spec = spec
        self.protocol = PROTOCOLS.get(spec.protocol)(spec)
        self.headers = {"Content-Type": "application/json"}
        if spec.api_key_env is not None:
            self.headers["Authorization"] = f"Bearer {os.environ[spec.api_key_env]}"

    def score(self, samples: list[RewardSample]) -> list[ModelScore]:
        """Every sample's ModelScore, in input order; never raises for a sample's failure."""
        return asyncio.run(self._score_all(samples))

    async def _score_all(self, samples: list[RewardSample]) -> list[ModelScore]:
        # Imported here: every reward worker and scoring process imports this module, and only
        # runs with an endpoint need aiohttp (~1 CPU-s to import).
        import aiohttp

        limit = asyncio.Semaphore(self.spec.max_concurrency)
        timeout = aiohttp.ClientTimeout(total=self.spec.timeout_s)
        connector = aiohttp.TCPConnector(limit=self.spec.max_concurrency)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=self.headers) as session:
            return list(await asyncio.gather(*(self._score_one(session, limit, s) for s in samples)))

    async def _score_one(self, session: "aiohttp.ClientSession", limit: asyncio.Semaphore,
                         sample: RewardSample) -> ModelScore:
        data = json.dumps(self.protocol.body(sample), default=str)  # a label may be any JSON-able value
        import aiohttp

        started = time.monotonic()
        attempt = 0
        while True:
            async with limit:
                try:
                    score, reply = await self._request(session, data)
                    return ModelScore(score, reply, latency_s=time.monotonic() - started, retries=attempt)
                except ReplyNotParsed as exc:  # the judge answered: asking again would mostly repeat it
                    return self._failed(f"reply not parsed: {exc}", attempt, started, exc.reply, parse_failed=True)
                except _Final as exc:
                    return self._failed(str(exc), attempt, started)
                except (asyncio.TimeoutError, aiohttp.ClientError, GarbageReply, _Retried) as exc:
                    error = _describe_failure(exc, self.spec.timeout_s)
            if attempt >= self.spec.max_retries:
                return self._failed(f"{error} (after {attempt + 1} attempts)", attempt, started)
            await asyncio.sleep(self.spec.backoff_s * 2**attempt)
            attempt += 1

    async def _request(self, session: "aiohttp.ClientSession", data: str) -> tuple[float, str | None]:
        async with session.post(self.spec.url, data=data) as response:
            text = await response.text(errors="replace")
            if response.status in RETRIED_STATUSES:
                raise _Retried(f"HTTP {response.status}: {text[:120]}")
            if response.status >= 400:
                raise _Final(f"HTTP {response.status}: {text[:200]}")
        try:
            payload = json.loads(text)
        except ValueError:
            raise GarbageReply(f"the body is not JSON: {text[:120]!r}") from None
        return self.protocol.read(payload)

    def _failed(self, error: str, attempt: int, started: float, reply: str | None = None,
                parse_failed: bool = False) -> ModelScore:
        logger.warning("model reward from %s failed: %s", self.spec.url, error)
        return ModelScore(self.spec.on_error, reply, error, parse_failed, time.monotonic() - started, attempt)


def _describe_failure(exc: BaseException, timeout_s: float) -> str:
    import aiohttp

    if isinstance(exc, asyncio.TimeoutError):
        return f"timed out after {timeout_s:g}s"
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, aiohttp.ClientError) else str(exc)
