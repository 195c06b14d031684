"""A colocated judge and the policy engine take turns on one device (rollout/judge_turns.py):
recording stand-ins for both engines, plugged in where the run builds them (the rollout-engine
registry for the policy, the judge's Ray engine class), record every start, sleep and wake-up; the
judge starts while the policy engine sleeps and sleeps once started, and through a step (with a
refill round) no two engines are awake at once, none while training."""
import asyncio
import socket
from unittest import mock

import pytest

from rlfactory_megatron.config import load_config
from rlfactory_megatron.rollout.engines import ROLLOUT_ENGINES


class Device:
    """One device's engines: which are awake, every call in order, and any moment two were awake."""

    def __init__(self) -> None:
        self.awake: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.crowded: list[list[tuple[str, str]]] = []

    def record(self, who: str, call: str) -> None:
        self.calls.append((who, call))
        if call in ("start", "wake_up"):
            self.awake.add(who)
        elif call == "sleep":
            self.awake.discard(who)
        if len(self.awake) > 1:
            self.crowded.append(list(self.calls))


DEVICE = Device()


class RecordingEngine:
    """An engine that only records its life on DEVICE (awake from its start, as vLLM's)."""

    message_bytes = 1 << 20

    def __init__(self, who: str) -> None:
        self.who = who
        DEVICE.record(who, "start")

    def sleep(self, level: int = 2) -> None:
        DEVICE.record(self.who, "sleep")

    def wake_up(self, tags=None) -> None:
        if self.who not in DEVICE.awake:
            DEVICE.record(self.who, "wake_up")

    def weight_names(self) -> dict:
        return {}

    def generate(self, prompts, sampling):
        raise AssertionError("not asked here")

    def close(self) -> None:
        DEVICE.record(self.who, "close")


ROLLOUT_ENGINES.register("recording-policy", lambda hf_dir, **kwargs: RecordingEngine("policy"))


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_colocated_judge_sleep_order(one_rank, ray_session, tmp_path):
    from rlfactory_megatron.rewards.served_judge import start_judge
    from rlfactory_megatron.rollout.fleet import EngineFleet
    from rlfactory_megatron.rollout.judge_turns import JudgeTurns
    from rlfactory_megatron.runtime.collectives import RankCollectives

    cfg = load_config(overrides=["rollout.engine=recording-policy", "reward.model.kind=generative",
                                 "reward.model.path=tiny://qwen3", "reward.model.placement=colocated",
                                 "reward.model.max_prompt_tokens=256", "reward.model.max_tokens=16",
                                 "reward.model.gpu_memory_utilization=0.3"])
    assert cfg.reward.model.gpu_memory_utilization == 0.3
    assert load_config().reward.model.gpu_memory_utilization == load_config().rollout.gpu_memory_utilization
    judge_engines = []

    def judge_engine(hf_dir, memory_utilization, **kwargs):
        judge_engines.append(memory_utilization)
        return RecordingEngine("judge")

    fleet = EngineFleet(cfg, str(tmp_path), tmp_path, RankCollectives())
    with mock.patch("rlfactory_megatron.rollout.ray_engine.RayVLLMEngine", judge_engine):
        turns = JudgeTurns(fleet, colocated=True)
        judge = turns.start(lambda: start_judge(cfg, fleet.layout))
    assert judge_engines == [0.3]  # its own share
    start = DEVICE.calls.index(("judge", "start"))
    assert ("policy", "sleep") in DEVICE.calls[:start], DEVICE.calls  # started while the policy engine slept
    assert DEVICE.awake == {"policy"}, DEVICE.calls  # the judge asleep once started, the policy awake

    seen = []

    async def phase():
        """A rollout phase as the generator runs it: the policy generates, then the judge judges."""
        await turns.before_generation()
        seen.append(("generate", set(DEVICE.awake)))
        async with turns.judging(judge):
            seen.append(("judge", set(DEVICE.awake)))

    for _ in range(2):  # a step: a rollout phase and a refill round, then training and the weight sync
        fleet.run(phase())
        fleet.run(phase())
        fleet.sleep()  # as Trainer.step does before training
        seen.append(("train", set(DEVICE.awake)))
        fleet.wake_up(["weights"])
        fleet.wake_up(["kv_cache"])
    assert seen == 2 * [("generate", {"policy"}), ("judge", {"judge"}), ("generate", {"policy"}), ("judge", {"judge"}),
                        ("train", set())]
    assert not DEVICE.crowded, DEVICE.crowded[0]
    asyncio.new_event_loop().run_until_complete(judge.close())
    fleet.close()
