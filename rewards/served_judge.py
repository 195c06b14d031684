"""A generative judge served by our own vLLM engines (`reward.model.kind: generative`): frozen
engines (no weight sync) behind the rollout router, each finished trajectory's JudgePrompt rendered
by the judge's chat template, its reply read by reward.model.parser; replies cached by (judge, input)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rlfactory_megatron.registry import Registry
from rlfactory_megatron.rewards.custom import RewardConfigError
from rlfactory_megatron.rewards.judge import JudgePrompt, ReplyNotParsed, reply_parser
from rlfactory_megatron.rewards.records import RewardSample
from rlfactory_megatron.rewards.remote import ModelScore

if TYPE_CHECKING:
    from rlfactory_megatron.rollout.engines import SamplingConfig

logger = logging.getLogger(__name__)

# own: engines on devices of their own, judging each trajectory as soon as it ends, while the
# others still generate; colocated: one engine on the generating process's devices, asleep while
# the policy generates, woken to judge the phase's trajectories at its end. Ray actors both.
PLACEMENTS = ("own", "colocated")
# A request whose engines all died is re-run on fresh ones this many times, then gets on_error.
MAX_REPLACEMENTS_PER_REQUEST = 3


@dataclass
class JudgeSpec:
    """The `reward.model` settings of a judge served by our engines (it pickles)."""

    kind: str
    path: str
    tp: int
    num_engines: int
    placement: str
    template: str | None
    parser: str
    max_tokens: int
    max_prompt_tokens: int
    temperature: float
    on_error: float
    gpu_memory_utilization: float  # its share of each of its devices (resolved at load)

    @classmethod
    def from_config(cls, reward) -> "JudgeSpec | None":
        """From the `reward` config section; None when `reward.model.kind` is null (no judge)."""
        model = reward.model
        if model.kind is None:
            return None
        if model.path is None:
            raise RewardConfigError(f"reward.model.path: reward.model.kind={model.kind} needs the judge's model: a "
                                    "Hugging Face folder (or tiny://qwen3 for a tiny test model)")
        return cls(model.kind, model.path, model.tp, model.num_engines, model.placement, model.template, model.parser,
                   model.max_tokens, model.max_prompt_tokens, model.temperature, model.on_error,
                   model.gpu_memory_utilization)

    def check(self) -> None:
        """Everything that can be known before an engine starts: refuses bad settings, naming the key."""
        if self.kind not in JUDGE_KINDS:
            raise RewardConfigError(f"reward.model.kind: unknown {self.kind!r}; choose one of "
                                    f"{', '.join(JUDGE_KINDS)} (or null: no judge)")
        if self.placement not in PLACEMENTS:
            raise RewardConfigError(f"reward.model.placement: unknown {self.placement!r}; choose one of "
                                    f"{', '.join(PLACEMENTS)}")
        for key in ("tp", "num_engines", "max_tokens", "max_prompt_tokens"):
            if getattr(self, key) < 1:
                raise RewardConfigError(f"reward.model.{key}: must be >= 1, got {getattr(self, key)}")
        if self.placement == "colocated" and self.num_engines != 1:
            raise RewardConfigError(f"reward.model.num_engines={self.num_engines}: a colocated judge is one engine on "
                                    "each generating process's devices; set it to 1, or reward.model.placement=own")
        if self.kind == "discriminative" and self.template is not None:
            raise RewardConfigError("reward.model.template: a discriminative reward model reads the task and the "
                                    "response as a chat, not a judge's prompt; drop the template (or kind=generative)")
        if not math.isfinite(self.on_error):
            raise RewardConfigError(f"reward.model.on_error: must be a finite number, got {self.on_error}")
        if not self.path.startswith("tiny://"):  # a tiny model is built at start-up, and checked there
            if not (Path(self.path) / "config.json").is_file():
                raise RewardConfigError(f"reward.model.path: {self.path!r} is not a Hugging Face model folder (no "
                                        "config.json); give the judge's local folder (or tiny://qwen3 for a tiny test "
                                        "model)")
            self.check_context(self.path)
        JudgePrompt.from_config(self.template)
        reply_parser(self.parser)

    def check_context(self, hf_dir: str) -> None:
        """The judge's prompt cap and reply cap fit the judge's context (vLLM refuses a longer one)."""
        config = json.loads((Path(hf_dir) / "config.json").read_text())
        context = config.get("max_position_embeddings")
        if context is not None and self.max_prompt_tokens + self.max_tokens > context:
            raise RewardConfigError(f"reward.model.max_prompt_tokens={self.max_prompt_tokens} + reward.model.max_tokens="
                                    f"{self.max_tokens} exceed the judge's context of {context} tokens "
                                    f"({hf_dir}); lower them")

    @property
    def overlaps_generation(self) -> bool:
        return self.placement == "own"


class ServedModelReward:
    """Scores samples with a frozen model on our engines: `score(sample)` on the event loop that
    serves them. `make_engine(index, replacement)` builds engine `index` (its `replacement`-th
    incarnation); one that dies is replaced and its requests re-run. `cache` (a
    ToolArtifactCache) answers an input asked before without an engine call. A kind says what
    it asks (`request`, `prompt_ids`), how (`_answer`) and how the answer is a score (`_value`)."""

    runner = "generate"  # the vLLM runner its engines use

    def __init__(self, spec: JudgeSpec, hf_dir: str, make_engine: Callable[[int, int], Any], cache=None) -> None:
        from transformers import AutoTokenizer

        from rlfactory_megatron.rollout.fronts import serving
        from rlfactory_megatron.rollout.fleet import engine_died
        from rlfactory_megatron.rollout.router import EngineRouter

        spec.check()
        self.spec, self.hf_dir, self.make_engine, self.cache = spec, hf_dir, make_engine, cache
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        # The cache's entries are this model's: its folder is in the name, its input in the key.
        self.cache_name = f"judge:{spec.kind}:{Path(hf_dir).resolve()}"
        self.engines = [make_engine(index, 0) for index in range(spec.num_engines)]
        self.router = EngineRouter([serving(engine) for engine in self.engines], is_failure=engine_died)
        self.replaced = 0
        self._replacing: asyncio.Lock | None = None

    def request(self, sample: RewardSample) -> dict:
        """What the model is asked about `sample` (JSON): the cache's key."""
        raise NotImplementedError

    def prompt_ids(self, request: dict) -> list[int]:
        raise NotImplementedError

    async def _answer(self, prompt_ids: list[int], request: dict) -> str | float:
        """The engines' answer (a judge's reply text, a reward model's score); EngineFailedError
        when no engine is left."""
        raise NotImplementedError

    def _value(self, answer: str | float) -> float:
        """The score in an answer; ReplyNotParsed when it holds none."""
        raise NotImplementedError

    async def score(self, sample: RewardSample) -> ModelScore:
        """This sample's model score; a failure (no engine left after replacements, a reply with no
        score, a prompt too long) is `on_error` with the reason, never a raise."""
        started = time.monotonic()
        request = self.request(sample)
        cached = self.cache.get(self.cache_name, request) if self.cache is not None else None
        if cached is not None:
            return self._read(cached.value, started, cached=True)
        prompt_ids = self.prompt_ids(request)
        if len(prompt_ids) > self.spec.max_prompt_tokens:
            return self._failed(f"the model's prompt has {len(prompt_ids)} tokens, over reward.model.max_prompt_tokens="
                                f"{self.spec.max_prompt_tokens}", started)
        try:
            answer = await self._on_live_engines(prompt_ids, request)
        except Exception as exc:  # noqa: BLE001 - the sample's failure, never the run's
            from rlfactory_megatron.rollout.router import error_line

            return self._failed(f"{self.spec.kind} engine: {error_line(exc)}", started)
        if self.cache is not None:
            self.cache.put(self.cache_name, request, answer)
        return self._read(answer, started)

    async def _on_live_engines(self, prompt_ids: list[int], request: dict) -> str | float:
        from rlfactory_megatron.rollout.router import EngineFailedError

        for attempt in range(MAX_REPLACEMENTS_PER_REQUEST + 1):
            try:
                return await self._answer(prompt_ids, request)
            except EngineFailedError:  # every engine died: fresh ones, and the request again
                if attempt == MAX_REPLACEMENTS_PER_REQUEST:
                    raise
                await self.replace_failed()
        raise AssertionError("unreachable")

    async def replace_failed(self) -> None:
        """A fresh engine in place of each that died (one replacement at a time, however many
        requests saw the deaths)."""
        from rlfactory_megatron.rollout.fronts import serving

        self._replacing = self._replacing or asyncio.Lock()
        async with self._replacing:
            for index, why in sorted(self.router.failed.items()):
                logger.warning("judge engine %d died (%s); starting a new one", index, why)
                print(f"rlf-train: judge engine {index} died ({why}); starting a new one", flush=True)
                # Its other requests fail on their own (and run again): closing its front before
                # they have would cancel them instead.
                while self.router.outstanding[index]:
                    await asyncio.sleep(0.01)
                await self.router.fronts[index].close()
                await asyncio.to_thread(_close_quietly, self.engines[index])
                self.replaced += 1
                self.engines[index] = await asyncio.to_thread(self.make_engine, index, self.replaced)
                self.router.revive(index, serving(self.engines[index]))

    async def sleep(self) -> None:
        """Colocated: the engines give their devices back (weights kept in host memory: a frozen
        model has no sync to bring them again)."""
        await asyncio.gather(*(asyncio.to_thread(engine.sleep, 1) for engine in self.engines))

    async def wake_up(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(engine.wake_up) for engine in self.engines))

    async def close(self) -> None:
        for front in self.router.fronts:
            await front.close()
        for engine in self.engines:
            _close_quietly(engine)

    def _read(self, answer: str | float, started: float, cached: bool = False) -> ModelScore:
        reply = answer if isinstance(answer, str) else None
        try:
            return ModelScore(self._value(answer), reply, latency_s=time.monotonic() - started, cached=cached)
        except ReplyNotParsed as exc:
            return self._failed(f"reply not parsed: {exc}", started, reply, parse_failed=True, cached=cached)

    def _failed(self, error: str, started: float, reply: str | None = None, parse_failed: bool = False,
                cached: bool = False) -> ModelScore:
        logger.warning("%s model %s failed a sample: %s", self.spec.kind, self.spec.path, error)
        return ModelScore(self.spec.on_error, reply, error, parse_failed, time.monotonic() - started, cached=cached)


class ServedJudge(ServedModelReward):
    """generative: the sample rendered by `reward.model.template`, put through the judge's chat
    template, answered by generation and read by `reward.model.parser`."""

    def __init__(self, spec: JudgeSpec, hf_dir: str, make_engine: Callable[[int, int], Any], cache=None) -> None:
        super().__init__(spec, hf_dir, make_engine, cache)
        self.prompt = JudgePrompt.from_config(spec.template)
        self.parse = reply_parser(spec.parser)

    def request(self, sample: RewardSample) -> dict:
        return {"messages": self.prompt.messages(sample), "max_tokens": self.spec.max_tokens,
                "temperature": self.spec.temperature}

    def prompt_ids(self, request: dict) -> list[int]:
        """The judge's prompt tokens: its chat template over the request's messages, ready for its reply."""
        return _chat_ids(self.tokenizer, request["messages"], add_generation_prompt=True)

    def sampling(self, request: dict) -> "SamplingConfig":
        """The engine sampling of one judge request; sampled (temperature > 0) with a seed of the
        input's own, so that a re-run request (its engine died) draws the same reply."""
        from rlfactory_megatron.rollout.engines import SamplingConfig

        seed = None
        if self.spec.temperature > 0:
            digest = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).digest()
            seed = int.from_bytes(digest[:4], "big") >> 1
        eos = self.tokenizer.eos_token_id
        return SamplingConfig(temperature=self.spec.temperature, max_tokens=self.spec.max_tokens,
                              stop_token_ids=() if eos is None else (eos,), seed=seed)

    async def _answer(self, prompt_ids: list[int], request: dict) -> str:
        ids, _ = await self.router.session().generate(prompt_ids, self.sampling(request))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _value(self, answer: str) -> float:
        return self.parse(answer)


class ServedRewardModel(ServedModelReward):
    """discriminative: a sequence-classification model (`...ForSequenceClassification`, one
    label) in vLLM's pooling runner; the task and the response as a chat (the model's template),
    its logit the score."""

    runner = "pooling"

    def request(self, sample: RewardSample) -> dict:
        return {"messages": [{"role": "user", "content": sample.prompt},
                             {"role": "assistant", "content": sample.response}]}

    def prompt_ids(self, request: dict) -> list[int]:
        return _chat_ids(self.tokenizer, request["messages"], add_generation_prompt=False)

    async def _answer(self, prompt_ids: list[int], request: dict) -> float:
        """The logit from the least busy live engine; an engine that dies is marked and the next one asked."""
        while True:
            index = self.router.least_loaded()  # EngineFailedError when none is left
            engine = self.engines[index]
            self.router.outstanding[index] += 1
            try:
                logits = await engine.classify([prompt_ids])
                return float(logits[0][0])
            except Exception as exc:
                if not self.router.is_failure(exc):
                    raise
                self.router.fail(index, exc)
            finally:
                self.router.outstanding[index] -= 1

    def _value(self, answer: float) -> float:
        return float(answer)


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _close_quietly(engine) -> None:
    try:
        engine.close()
    except Exception:  # noqa: BLE001 - a dead engine's close fails; nothing is left to release
        pass


JUDGE_KINDS: Registry[type] = Registry("reward.model kind")
JUDGE_KINDS.register("generative", ServedJudge)
JUDGE_KINDS.register("discriminative", ServedRewardModel)


def start_judge(cfg, layout, cache=None) -> ServedModelReward | None:
    """The run's judge on this generating process (None without `reward.model.kind`): Ray actors
    (a process of its own each, as this one may hold the policy's in-process engine), placement
    own: `num_engines` with devices of their own; colocated: one on this process's engine devices,
    with vLLM's sleep mode on GPU, asleep once started (started while the policy engine sleeps:
    rollout/judge_turns.py). They serve up to the judge's prompt and reply caps, as many
    requests at once as a rollout engine (rollout.max_num_seqs)."""
    import torch

    from rlfactory_megatron.rollout.fleet import engine_visible_devices
    from rlfactory_megatron.rollout.ray_engine import RayVLLMEngine
    from rlfactory_megatron.trainer.model_path import resolve_model_path

    spec = JudgeSpec.from_config(cfg.reward)
    if spec is None:
        return None
    hf_dir = str(resolve_model_path(spec.path, key="reward.model.path"))
    spec.check_context(hf_dir)
    kind = JUDGE_KINDS.get(spec.kind)
    on_gpu = torch.cuda.is_available()
    engine_args = dict(dtype=cfg.model.params_dtype, tensor_parallel_size=spec.tp,
                       max_model_len=spec.max_prompt_tokens + spec.max_tokens, max_num_seqs=cfg.rollout.max_num_seqs,
                       memory_utilization=spec.gpu_memory_utilization, seed=cfg.trainer.seed, runner=kind.runner)
    placement = {"num_gpus": spec.tp if on_gpu else 0}
    if not spec.overlaps_generation:
        placement = {"num_gpus": 0, "enable_sleep_mode": on_gpu}
        if on_gpu:  # the devices of this process's engine group, as Ray gives a zero-GPU actor none
            import os

            placement["env"] = {"CUDA_VISIBLE_DEVICES": engine_visible_devices(
                os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(), torch.cuda.current_device(), spec.tp)}

    def make_engine(index: int, replacement: int):
        name = f"rlf-judge-{layout.producer}-{index}" + (f"-{replacement}" if replacement else "")
        return RayVLLMEngine(hf_dir, num_cpus=1, name=name, **placement, **engine_args)

    judge = kind(spec, hf_dir, make_engine, cache)
    for engine in judge.engines:  # a judge that cannot start stops the run here, with its engine's error
        engine.weight_names()
        if not spec.overlaps_generation:  # asleep from the start: the policy engine generates first
            engine.sleep(1)
    return judge
