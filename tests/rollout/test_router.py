"""The request router: a trajectory's first turn goes to the least-loaded engine, every later
turn to the same one; a slow engine gets fewer new trajectories."""
import asyncio

from rlfactory_megatron.rollout.router import EngineRouter


class Engine:
    """An engine whose every call takes `delay_s`; it records which prompts it served."""

    def __init__(self, delay_s: float):
        self.delay_s, self.served, self.requests, self.busy_s = delay_s, [], 0, 0.0

    async def generate(self, prompt, sampling):
        self.served.append(prompt[0])
        self.requests += 1
        await asyncio.sleep(self.delay_s)
        return [7, 8], [-0.1, -0.2]


def test_turns_stay_on_one_engine_and_a_slow_engine_gets_fewer_trajectories():
    fast, slow = Engine(0.0), Engine(0.05)
    router = EngineRouter([slow, fast])

    async def trajectory(index):
        await asyncio.sleep(0.002 * index)  # arriving over time, as the agent loops of a step do
        session = router.session()
        for _ in range(3):  # three turns
            await session.generate([index], {})
        return session.engine

    async def step():
        return await asyncio.gather(*(trajectory(i) for i in range(40)))

    engines = asyncio.run(step())
    for index, engine in enumerate(engines):  # all three turns of a trajectory on one engine
        assert [router.engines[engine].served.count(index), router.engines[1 - engine].served.count(index)] == [3, 0]
    assert engines.count(1) >= 30, engines.count(1)  # the fast engine served most trajectories
    assert router.outstanding == [0, 0]


def test_concurrent_first_turns_spread_over_idle_engines():
    engines = [Engine(0.01) for _ in range(3)]
    router = EngineRouter(engines)

    async def step():
        sessions = [router.session() for _ in range(6)]
        await asyncio.gather(*(s.generate([i], {}) for i, s in enumerate(sessions)))
        return [s.engine for s in sessions]

    assert sorted(asyncio.run(step())) == [0, 0, 1, 1, 2, 2]
