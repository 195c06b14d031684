"""The request router: a trajectory's first turn goes to the least-loaded engine, every later
turn to the same one; a slow engine gets fewer new trajectories."""
import asyncio

import numpy as np

from rlfactory_megatron.rollout.engines import SamplingConfig
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
            await session.generate([index], SamplingConfig())
        return session.engine_index

    async def step():
        return await asyncio.gather(*(trajectory(i) for i in range(40)))

    engines = asyncio.run(step())
    for index, engine in enumerate(engines):  # all three turns of a trajectory on one engine
        assert [router.fronts[engine].served.count(index), router.fronts[1 - engine].served.count(index)] == [3, 0]
    assert engines.count(1) >= 30, engines.count(1)  # the fast engine served most trajectories
    assert router.outstanding == [0, 0]


def test_concurrent_first_turns_spread_over_idle_engines():
    engines = [Engine(0.01) for _ in range(3)]
    router = EngineRouter(engines)

    async def step():
        sessions = [router.session() for _ in range(6)]
        await asyncio.gather(*(s.generate([i], SamplingConfig()) for i, s in enumerate(sessions)))
        return [s.engine_index for s in sessions]

    assert sorted(asyncio.run(step())) == [0, 0, 1, 1, 2, 2]


class Dying(Engine):
    """Serves `calls` requests, then fails every request as a dead engine process does."""

    def __init__(self, calls: int):
        super().__init__(0.001)
        self.calls = calls

    async def generate(self, prompt, sampling):
        if self.calls == 0:
            raise ConnectionError("engine process died")
        self.calls -= 1
        return await super().generate(prompt, sampling)


def test_requests_of_a_failed_engine_run_again_on_the_others():
    import pytest

    from rlfactory_megatron.rollout.router import EngineFailedError

    dying, healthy = Dying(calls=3), Engine(0.001)
    router = EngineRouter([dying, healthy], is_failure=lambda exc: isinstance(exc, ConnectionError))

    async def trajectory(index):
        session = router.session()
        return [await session.generate([index], SamplingConfig()) for _ in range(3)]

    async def step(n):
        return await asyncio.gather(*(trajectory(i) for i in range(n)))

    results = asyncio.run(step(6))
    assert all(turns == [([7, 8], [-0.1, -0.2])] * 3 for turns in results)  # every turn of every trajectory served
    assert list(router.failed) == [0] and "died" in router.failed[0]
    assert sorted(healthy.served + dying.served[:3]) == sorted([i for i in range(6) for _ in range(3)])
    router.revive(0, Engine(0.0))  # a replacement serves again
    asyncio.run(step(2))
    assert router.fronts[0].served and not router.failed
    router.fail(0, ConnectionError("gone")), router.fail(1, ConnectionError("gone too"))
    with pytest.raises(EngineFailedError, match="every rollout engine failed: engine 0: ConnectionError: gone"):
        asyncio.run(step(1))


def test_a_pause_lets_running_calls_finish_holds_new_ones_and_each_call_keeps_its_version():
    # A weight update in flight: pause() returns once no call is under way, calls made meanwhile
    # wait, and after resume(version) they run on the new version, which the session records for
    # the tokens each call generated.
    engine = Engine(0.02)
    router = EngineRouter([engine])

    async def run():
        session = router.session()
        first = asyncio.create_task(session.generate([1], SamplingConfig()))
        await asyncio.sleep(0.005)  # the first call is under way
        await router.pause()
        assert first.done() and engine.requests == 1  # it finished before the pause returned
        second = asyncio.create_task(session.generate([1, 7, 8], SamplingConfig()))
        await asyncio.sleep(0.05)
        assert not second.done() and engine.requests == 1  # held while the weights change
        await router.resume(4)
        await second
        return session

    session = asyncio.run(run())
    assert session.calls == [(0, 0, 2), (0, 4, 2)]
    assert session.token_versions(4) == [0, 0, 4, 4]
    assert session.token_versions(3) == [0, 0, 4]  # the agent loop kept fewer tokens
    assert router.outstanding == [0]


def test_an_engine_that_fails_a_step_inside_a_live_actor_counts_as_dead():
    # What rlf-train's router is given: a Ray actor's death and a failed vLLM step inside a live
    # actor both move the requests to the other engines; a bad request does not.
    from rlfactory_megatron.rollout.fronts import EngineStepError
    from rlfactory_megatron.rollout.fleet import engine_died

    class FailingStep(Engine):
        async def generate(self, prompt, sampling):
            raise EngineStepError("the engine failed a step: RuntimeError: core died")

    healthy = Engine(0.001)
    router = EngineRouter([FailingStep(0.0), healthy], is_failure=engine_died)
    results = asyncio.run(_all(router.session().generate([i], SamplingConfig()) for i in range(4)))
    assert results == [([7, 8], [-0.1, -0.2])] * 4 and sorted(healthy.served) == [0, 1, 2, 3]
    assert list(router.failed) == [0] and "failed a step" in router.failed[0]
    assert not engine_died(ValueError("prompt too long"))


async def _all(calls):
    return await asyncio.gather(*calls)


def test_an_interrupting_pause_cuts_running_calls_and_each_goes_on_with_its_tokens_on_the_new_version():
    # Partial rollout: pause(interrupt=True) has the engine end its calls now; after resume each
    # goes on as a request whose prompt holds the tokens it had, for the tokens left, with a seed
    # of its own (its own seed would repeat the first tokens' draws). An engine that cannot
    # interrupt (here: the second) is waited for, as without the flag.
    from rlfactory_megatron.rollout.fronts import GenerationInterrupted

    class Interruptible:
        requests, busy_s = 0, 0.0

        def __init__(self):
            self.seen, self.cut, self.held = [], asyncio.Event(), False

        async def generate(self, prompt, sampling):
            self.seen.append((list(prompt), sampling))
            if self.held:
                raise GenerationInterrupted([], [])
            if len(self.seen) == 1:
                await self.cut.wait()
                raise GenerationInterrupted([40, 41, 42], [-0.4, -0.41, -0.42])
            return [50] * sampling.max_tokens, [-0.5] * sampling.max_tokens

        async def interrupt(self):
            self.held = True
            self.cut.set()

        async def release(self):
            self.held = False

    cutting, waited = Interruptible(), Engine(0.05)
    router = EngineRouter([cutting, waited])

    async def run():
        sessions = [router.session(), router.session()]
        calls = [asyncio.create_task(s.generate([1, 2], SamplingConfig(max_tokens=8, seed=5))) for s in sessions]
        await asyncio.sleep(0.01)
        await router.pause(interrupt=True)
        assert calls[1].done() and not calls[0].done()  # the one that cannot interrupt finished
        await router.resume(2)
        return await asyncio.gather(*calls), sessions

    (cut, whole), sessions = asyncio.run(run())
    assert cut == ([40, 41, 42, 50, 50, 50, 50, 50], [-0.4, -0.41, -0.42] + [-0.5] * 5)
    assert whole == ([7, 8], [-0.1, -0.2])
    (first_prompt, first), (prompt, rest) = cutting.seen
    assert first_prompt == [1, 2] and first == SamplingConfig(max_tokens=8, seed=5)
    assert prompt == [1, 2, 40, 41, 42] and rest.max_tokens == 5 and rest.seed not in (None, 5)
    assert sessions[0].calls == [(0, 0, 3), (0, 2, 5)] and sessions[1].calls == [(1, 0, 2)]
    assert router.outstanding == [0, 0]


def test_an_engine_that_stays_held_after_a_weight_update_counts_as_failed_and_its_requests_move():
    # Its release failed (or it cuts requests with no update under way): a request there would be
    # cut again forever. The router marks it failed, and the request runs again on another engine.
    from rlfactory_megatron.rollout.fronts import EngineStepError, GenerationInterrupted

    class Stuck(Engine):
        def __init__(self):
            super().__init__(0.0)
            self.cut = asyncio.Event()

        async def generate(self, prompt, sampling):
            self.requests += 1
            await self.cut.wait()
            raise GenerationInterrupted([5], [-0.5])

        async def interrupt(self):
            self.cut.set()

        async def release(self):
            raise ConnectionError("release lost")

    def died(exc):
        return isinstance(exc, EngineStepError)

    stuck = Stuck()
    router = EngineRouter([stuck, Engine(0.0)], is_failure=died)

    async def run():
        session = router.session()
        call = asyncio.create_task(session.generate([3], SamplingConfig()))  # on engine 0, the least loaded
        await asyncio.sleep(0.01)
        await router.pause(interrupt=True)
        await router.resume(1)
        return await call, session

    (ids, _), session = asyncio.run(run())
    assert router.failed == {0: "ConnectionError: release lost"}
    assert ids == [7, 8] and session.calls == [(1, 1, 2)] and stuck.requests == 1
    assert router.outstanding == [0, 0]

    # Cut with no weight update under way: the engine is stuck in one.
    stuck = Stuck()
    stuck.cut.set()
    router = EngineRouter([stuck, Engine(0.0)], is_failure=died)

    async def cut_for_nothing():
        return await router.session().generate([3], SamplingConfig())

    assert asyncio.run(cut_for_nothing())[0] == [7, 8]
    assert "cut a request with no weight update under way" in router.failed[0]


class RoutingEngine(Engine):
    """Answers as an engine recording its routes does (routing replay R3): every position of the
    prompt and of the sampled tokens but the last, those its prefix cache served -1; each call's
    routes hold the call's number."""

    def __init__(self, cached: int):
        super().__init__(0.0)
        self.cached = cached

    async def generate(self, prompt, sampling):
        from rlfactory_megatron.envs.agent_loop import Completion

        await super().generate(prompt, sampling)
        routes = np.full((len(prompt) + 2 - 1, 3, 2), self.requests, dtype=np.int16)
        routes[: self.cached if self.requests > 1 else 0] = -1
        return Completion([7, 8], [-0.1, -0.2], routes)


def test_routes_come_back_through_the_session_and_merge_over_turns_into_the_batch():
    import pickle

    import torch

    from rlfactory_megatron.actor.batch import pad_rows
    from rlfactory_megatron.envs.agent_loop import Completion, merge_routes
    from rlfactory_megatron.rollout.rows import RowData, with_engine_routes

    router = EngineRouter([RoutingEngine(cached=2)])

    async def two_turns():
        session = router.session()
        first = await session.generate([1, 2, 3], SamplingConfig())
        second = await session.generate([1, 2, 3, 7, 8, 5, 6], SamplingConfig())  # + an observation
        return first, second

    first, second = asyncio.run(two_turns())
    assert first == ([7, 8], [-0.1, -0.2]) and list(first) == [[7, 8], [-0.1, -0.2]]  # still a pair
    assert pickle.loads(pickle.dumps(second)).routes.tolist() == second.routes.tolist()  # across processes
    # Each position keeps the routes of the call that computed it first (the one that sampled the
    # token after it): turn 1's prompt and tokens; turn 2's observation and tokens.
    routes = merge_routes(first.routes, second.routes)
    assert routes[:, 0, 0].tolist() == [1, 1, 1, 1, 2, 2, 2, 2]
    assert merge_routes(None, first.routes) is first.routes and merge_routes(first.routes, None) is first.routes

    # The row's routes into the batch, aligned like the log-probs: token t has position t - 1's.
    ids = [1, 2, 3, 7, 8, 5, 6, 7, 8]
    row = RowData(0, np.array(ids[:3]), np.array(ids[3:]), np.ones(6, np.int8), np.zeros(6, np.float32),
                  np.zeros(6, np.int32), routes=routes)
    batch = with_engine_routes(pad_rows([ids, [1, 2]], [[0, 0, 0] + [1] * 6, [0, 1]]),
                               [row, RowData(1, np.array([1]), np.array([2]), np.ones(1, np.int8),
                                             np.zeros(1, np.float32), np.zeros(1, np.int32))])
    assert batch.routes.shape == (2, 9, 3, 2) and batch.routes.dtype == torch.int16
    assert batch.routes[0, :, 0, 0].tolist() == [-1, 1, 1, 1, 1, 2, 2, 2, 2]
    assert (batch.routes[1] == -1).all()  # a row without routes: every token routes for itself
    assert Completion([1], [0.0]).routes is None
