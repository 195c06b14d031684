"""A calculator tool and a reward function that misbehave at random, in every way a real one can:
for the fault test through the real `rlf-train` (Ray workers import this module by name)."""
import asyncio
import fcntl
import math
import os
import random
import time

from rlfactory_megatron.envs.tools import ToolResult
from rlfactory_megatron.envs.tools.calculator import CalculatorTool
from rlfactory_megatron.rewards.scorers import get_scorer

TOOL_FAULTS = ("raise", "hang", "block", "huge", "exit", "surrogates", "ok", "ok", "ok")
REWARD_FAULTS = ("raise", "hang", "exit", "nan", "inf", "string", "ok", "ok", "ok", "ok", "ok", "ok")
_rng = random.Random(os.getpid() ^ int(time.time() * 1e6))


class FaultyCalculator(CalculatorTool):
    """The calculator (same name and schema, so the policy calls it) with a fault on most calls."""

    async def execute(self, args):
        fault = _rng.choice(TOOL_FAULTS)
        if fault == "raise":
            raise RuntimeError("calculator exploded")
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "block":
            time.sleep(3)  # blocks the actor's event loop
        if fault == "huge":
            return ToolResult("9" * (4 << 20))
        if fault == "exit":
            os._exit(3)
        result = await super().execute(args)
        if fault == "surrogates":
            return ToolResult(result.text + b" \xff\xfe".decode("utf-8", "surrogateescape") + "\ud800")
        return result


def compute_score(data_source, solution_str, ground_truth, extra_info):
    fault = _rng.choice(REWARD_FAULTS)
    if fault == "raise":
        raise ValueError("reward exploded")
    if fault == "hang":
        _hang_counting_the_others()
    if fault == "exit":
        os._exit(4)
    if fault == "nan":
        return math.nan
    if fault == "inf":
        return -math.inf
    if fault == "string":
        return "1.0"
    return get_scorer("gsm8k")(solution_str, ground_truth)


def _hang_counting_the_others() -> None:
    """Hang until the pool kills this scoring process. Where RLF_TEST_HUNG_DIR names a folder, first
    write how many other hung scorers are alive now: each holds an exclusive lock on a file of its
    own, which the kernel drops when the process dies, so a lock held is a scorer alive. A pool that
    scored hung samples one after another would never show one beside another, however loaded the
    host: the fault test asserts concurrency by this count, not by wall time."""
    folder = os.environ.get("RLF_TEST_HUNG_DIR")
    if folder:
        mine = f"{os.getpid()}.lock"
        fd = os.open(os.path.join(folder, mine), os.O_CREAT | os.O_RDWR)  # kept open: the lock lives with us
        fcntl.flock(fd, fcntl.LOCK_EX)
        alive = 0
        for name in os.listdir(folder):
            if name.endswith(".lock") and name != mine:
                other = os.open(os.path.join(folder, name), os.O_RDWR)
                try:
                    fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)  # checkers share; only a holder blocks
                except BlockingIOError:
                    alive += 1
                finally:
                    os.close(other)
        with open(os.path.join(folder, f"{os.getpid()}.seen"), "w") as f:
            f.write(str(alive))
    time.sleep(3600)


class EngineKillingCalculator(CalculatorTool):
    """The calculator (same name and schema), whose first call of the run kills the first
    disaggregated rollout engine (a Ray actor named rlf-engine-0) in the middle of a step."""

    async def execute(self, args):
        _kill_engine_once()
        return await super().execute(args)


def _kill_engine_once() -> None:
    """Kill rollout engine rlf-engine-0 (a Ray actor) at the first call of the run, in whichever
    tool worker takes it: the file named by RLF_TEST_KILL_ENGINE_ONCE marks it done. Per worker
    process instead, a second worker's first call would find the name gone (a tool error the run
    without a kill does not have) or kill the engine that replaced it. Looking the actor up takes
    seconds, more on a loaded machine (and never returns in a thread beside the actor's event
    loop): the tests that use this raise tools.call_timeout_s, so that the call answers as the
    plain calculator does."""
    try:
        os.close(os.open(os.environ["RLF_TEST_KILL_ENGINE_ONCE"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    import ray

    # RLF_TEST_ALSO_KILL: more actors to kill with it (a judge engine, rlf-judge-0-0).
    for name in ["rlf-engine-0", *filter(None, os.environ.get("RLF_TEST_ALSO_KILL", "").split(","))]:
        ray.kill(ray.get_actor(name), no_restart=True)


class SlowCalculator(CalculatorTool):
    """The calculator, answering after DELAY_S: a trajectory waiting for it is still in flight when
    a short training step ends, so an asynchronous run's weight update lands between its turns."""

    DELAY_S = 3.0

    async def execute(self, args):
        await asyncio.sleep(self.DELAY_S)
        return await super().execute(args)


class SlowEngineKillingCalculator(SlowCalculator):
    """The slow calculator whose first call of the run kills engine rlf-engine-0, with the batch
    ahead in flight (asynchronous RL)."""

    async def execute(self, args):
        _kill_engine_once()
        return await super().execute(args)
