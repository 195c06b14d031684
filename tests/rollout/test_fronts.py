"""The streaming front of a steppable engine (vLLM's in-process one): each caller resumes when its
own request finishes, not when a batch does; samples are the batch path's; a bad request, a
cancelled caller and a closed front each leave the rest served and the engine clean."""
import asyncio
from dataclasses import replace

import pytest

from rlfactory_megatron.rollout.engines import SamplingConfig
from rlfactory_megatron.rollout.fronts import (
    BatchingFront, EngineStepError, GenerationInterrupted, StreamingFront, serving)

from rollout_workers import SignallingEngine

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42, 8], [9, 9, 31], [100, 3, 77, 12, 6], [5, 17, 42, 8]]


@pytest.fixture(scope="module")
def engine(tiny_hf_dirs):
    from rlfactory_megatron.rollout.engines import VLLMEngine

    engine = VLLMEngine(tiny_hf_dirs["qwen3"], max_model_len=128, max_num_seqs=16)
    yield engine
    engine.close()


def test_serving_streams_a_steppable_engine_and_batches_one_that_is_not(engine):
    class BatchOnly:
        def generate(self, prompts, sampling, seeds=None): ...

    assert isinstance(serving(engine), StreamingFront)
    assert isinstance(serving(BatchOnly()), BatchingFront)


def test_a_short_request_returns_while_a_long_one_still_decodes(engine):
    async def go():
        front = StreamingFront(engine)
        finished_at = {}

        async def one(name, max_tokens):
            ids, _ = await front.generate(PROMPTS[0], SamplingConfig(temperature=1.0, max_tokens=max_tokens, seed=1))
            finished_at[name] = (front.steps, len(ids))

        try:
            await asyncio.gather(one("short", 2), one("long", 40))
        finally:
            await front.close()
        return finished_at

    finished_at = asyncio.run(go())
    assert finished_at["short"][1] == 2 and finished_at["long"][1] == 40
    # The short caller resumed after the step that finished it, ~38 steps before the long one ended.
    assert finished_at["short"][0] <= 4 < 30 <= finished_at["long"][0]


def test_streamed_samples_equal_the_batch_path_and_arrive_in_any_order(engine):
    config = SamplingConfig(temperature=1.0, max_tokens=12)
    direct = engine.generate(PROMPTS, config, seeds=[3, 4, 5, 11])

    async def go():
        front = StreamingFront(engine)
        try:
            early = front.generate(PROMPTS[3], replace(config, seed=11))  # alone, before the others
            first = await early
            rest = await asyncio.gather(*(front.generate(p, replace(config, seed=s))
                                          for p, s in zip(PROMPTS[:3], (3, 4, 5))))
            return [*rest, first]
        finally:
            await front.close()

    streamed = asyncio.run(go())
    for (ids, log_probs), samples in zip(streamed, direct):
        assert ids == samples[0].token_ids
        assert log_probs == pytest.approx(samples[0].log_probs, abs=1e-5)


def test_a_refused_request_fails_alone_and_a_cancelled_one_is_aborted(engine):
    async def go():
        front = StreamingFront(engine)
        try:
            too_long = front.generate(list(range(10, 300)), SamplingConfig(max_tokens=4))  # over max_model_len 128
            fine = front.generate(PROMPTS[1], SamplingConfig(max_tokens=6, seed=2))
            doomed = asyncio.ensure_future(front.generate(PROMPTS[2], SamplingConfig(max_tokens=100, seed=3)))
            results = await asyncio.gather(too_long, fine, return_exceptions=True)
            doomed.cancel()
            await asyncio.gather(doomed, return_exceptions=True)
            after = await front.generate(PROMPTS[0], SamplingConfig(max_tokens=3, seed=4))  # the front still serves
            return results, after
        finally:
            await front.close()

    (refused, fine), after = asyncio.run(go())
    assert isinstance(refused, Exception) and "maximum context length is 128" in str(refused)
    assert len(fine[0]) == 6 and len(after[0]) == 3
    assert not engine.llm.llm_engine.has_unfinished_requests()  # the cancelled request left the engine


def test_closing_with_requests_in_flight_cancels_their_callers_and_empties_the_engine(engine):
    async def go():
        front = StreamingFront(engine)
        pending = [asyncio.ensure_future(front.generate(p, SamplingConfig(max_tokens=100, seed=i)))
                   for i, p in enumerate(PROMPTS)]
        while not front._running:  # in the engine
            await asyncio.sleep(0.01)
        await front.close()
        return await asyncio.gather(*pending, return_exceptions=True)

    results = asyncio.run(go())
    # Callers still waiting are cancelled (a sample may have ended early, at its end-of-turn token).
    assert any(isinstance(r, asyncio.CancelledError) for r in results)
    assert all(isinstance(r, (asyncio.CancelledError, tuple)) for r in results)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    # A new event loop (the next rollout phase) is served again.
    ids, _ = asyncio.run(_once(engine))
    assert len(ids) == 5


def test_a_failed_engine_step_fails_every_caller_and_the_front_serves_no_more(engine):
    # A fault injected at the engine's step (as a vLLM engine whose core died raises there): the
    # callers see EngineStepError, which the router takes as the engine's death, and a new call
    # is refused at once instead of waiting on a broken engine.
    steps = 0

    def failing_step():
        nonlocal steps
        steps += 1
        if steps == 3:
            raise RuntimeError("injected: the engine core died")
        return type(engine).step(engine)

    async def go():
        front = StreamingFront(engine)
        engine.step = failing_step
        try:
            results = await asyncio.gather(*(front.generate(p, SamplingConfig(max_tokens=50, seed=i))
                                             for i, p in enumerate(PROMPTS)), return_exceptions=True)
            with pytest.raises(EngineStepError, match="injected"):
                await front.generate(PROMPTS[0], SamplingConfig(max_tokens=2))
            return results, list(front._orphans)
        finally:
            del engine.step
            await front.close()

    results, left_in_engine = asyncio.run(go())
    engine.abort(left_in_engine)  # this test's leftovers, for the next tests on the shared engine
    failed = [r for r in results if isinstance(r, EngineStepError)]
    assert failed and all(isinstance(r, (EngineStepError, tuple)) for r in results), results
    assert "the engine failed a step: RuntimeError: injected" in str(failed[0])
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_an_interrupt_ends_requests_between_steps_with_their_tokens_and_holds_later_ones(engine):
    # Partial rollout's cut: each running request ends after the step under way with the tokens
    # (and log-probs) it had, those a run without the cut generated first; until release(), a new
    # request ends at once with none; then the front serves again.
    config = SamplingConfig(temperature=1.0, max_tokens=60)
    reference = engine.generate([PROMPTS[0], PROMPTS[2]], config, seeds=[7, 8])

    async def go():
        stepped = SignallingEngine(engine, after=5)
        front = StreamingFront(stepped)
        try:
            running = [asyncio.ensure_future(front.generate(p, replace(config, seed=seed)))
                       for p, seed in ((PROMPTS[0], 7), (PROMPTS[2], 8))]
            await stepped.reached.wait()
            await front.interrupt()
            assert all(request.done() for request in running)  # interrupt() returns with the engine empty
            cut = await asyncio.gather(*running, return_exceptions=True)
            held = await asyncio.gather(front.generate(PROMPTS[1], replace(config, seed=2)), return_exceptions=True)
            await front.release()
            after = await front.generate(PROMPTS[1], SamplingConfig(max_tokens=4, seed=2))
            return cut, held[0], after
        finally:
            await front.close()

    cut, held, after = asyncio.run(go())
    for interrupted, samples in zip(cut, reference):
        assert isinstance(interrupted, GenerationInterrupted), cut
        done = len(interrupted.token_ids)
        assert 5 <= done < len(samples[0].token_ids) == 60, done
        assert interrupted.token_ids == samples[0].token_ids[:done]
        assert interrupted.log_probs == pytest.approx(samples[0].log_probs[:done], abs=1e-5)
    assert isinstance(held, GenerationInterrupted) and held.token_ids == []
    assert len(after[0]) == 4
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_an_interrupted_request_goes_on_after_the_resume_as_if_never_cut(engine):
    # Through the router: a request cut mid-decode continues as a new request whose prompt holds
    # its tokens. Greedy on unchanged weights, the continuation is exactly the uncut request (its
    # KV computed again gives the same tokens and log-probs); the session records each engine call.
    from rlfactory_megatron.rollout.router import EngineRouter

    greedy = SamplingConfig(temperature=0.0, max_tokens=60)
    [[reference]] = engine.generate([PROMPTS[0]], greedy)
    assert len(reference.token_ids) == 60  # no end-of-turn token before the cap

    async def go():
        stepped = SignallingEngine(engine, after=5)
        router = EngineRouter([StreamingFront(stepped)])
        session = router.session()
        try:
            request = asyncio.ensure_future(session.generate(PROMPTS[0], greedy))
            await stepped.reached.wait()
            await router.pause(interrupt=True)
            assert not request.done()  # held by the router until the weights are in
            await router.resume(3)
            return await request, session
        finally:
            await router.fronts[0].close()

    (ids, log_probs), session = asyncio.run(go())
    assert ids == reference.token_ids
    assert log_probs == pytest.approx(reference.log_probs, abs=1e-5)
    (_, v0, before), (_, v1, rest) = session.calls
    assert (v0, v1) == (0, 3) and before >= 5 and before + rest == 60
    assert session.token_versions(60) == [0] * before + [3] * rest


def test_an_engine_that_fails_while_interrupted_fails_its_callers_and_the_interrupt_returns(engine):
    # The engine core dies between two steps, so ending its requests fails: the interrupt still
    # returns (a weight sync must not hang on it), the callers see the engine's death, which the
    # router takes as such, and the front serves no more.
    async def go():
        stepped = SignallingEngine(engine, after=3)

        def dead(request_ids):
            raise RuntimeError("injected: the engine core died")

        stepped.interrupt = dead
        front = StreamingFront(stepped)
        try:
            running = asyncio.ensure_future(front.generate(PROMPTS[0], SamplingConfig(max_tokens=60, seed=3)))
            await stepped.reached.wait()
            await asyncio.wait_for(front.interrupt(), 60)
            result = await asyncio.gather(running, return_exceptions=True)
            later = await asyncio.gather(front.generate(PROMPTS[1], SamplingConfig(max_tokens=2)), return_exceptions=True)
            return result[0], later[0], list(front._orphans)
        finally:
            await front.close()

    result, later, left_in_engine = asyncio.run(go())
    engine.abort(left_in_engine)  # this test's leftovers, for the next tests on the shared engine
    assert isinstance(result, EngineStepError) and "injected" in str(result)
    assert isinstance(later, EngineStepError)
    assert not engine.llm.llm_engine.has_unfinished_requests()


async def _once(engine):
    front = StreamingFront(engine)
    try:
        return await front.generate(PROMPTS[0], SamplingConfig(max_tokens=5, seed=9))
    finally:
        await front.close()


# A Ray-hosted engine streams on its side: the actor runs a StreamingFront, and the client sends the
# requests of one window in one call whose results come back one by one, as each request finishes.

@pytest.fixture(scope="module")
def hosted(tiny_hf_dirs, ray_session):
    from rlfactory_megatron.rollout.ray_engine import RayVLLMEngine

    engine = RayVLLMEngine(tiny_hf_dirs["qwen3"], max_model_len=128, max_num_seqs=16)
    yield engine
    engine.close()


def test_a_hosted_engine_streams_its_results_and_a_next_turn_overlaps_a_long_request(hosted, engine):
    from rlfactory_megatron.rollout.fronts import RemoteFront

    config = SamplingConfig(temperature=1.0, max_tokens=12)
    direct = engine.generate(PROMPTS, config, seeds=[3, 4, 5, 11])
    order = []

    async def one(front, name, prompt, sampling):
        result = await front.generate(prompt, sampling)
        order.append(name)
        return result

    async def go():
        front = serving(hosted)
        assert isinstance(front, RemoteFront)
        try:
            long = asyncio.ensure_future(one(front, "long", PROMPTS[0], SamplingConfig(temperature=1.0, max_tokens=100, seed=1)))
            await one(front, "short", PROMPTS[1], SamplingConfig(temperature=1.0, max_tokens=2, seed=2))
            # The short one's next turn: a call of its own, which joins the long one's running batch.
            await one(front, "next turn", PROMPTS[1], SamplingConfig(temperature=1.0, max_tokens=2, seed=3))
            same = await asyncio.gather(*(front.generate(p, replace(config, seed=s))
                                          for p, s in zip(PROMPTS, (3, 4, 5, 11))))
            refused = await asyncio.gather(front.generate(list(range(10, 300)), SamplingConfig(max_tokens=4)),
                                           front.generate(PROMPTS[2], SamplingConfig(max_tokens=3, seed=6)),
                                           return_exceptions=True)
            return (await long), same, refused, front
        finally:
            await front.close()

    long, same, (too_long, fine), front = asyncio.run(go())
    assert len(long[0]) == 100
    assert order.index("next turn") < order.index("long")  # not held until the long request's batch ends
    for (ids, log_probs), samples in zip(same, direct):  # the colocated engine's samples, seed for seed
        assert ids == samples[0].token_ids
        assert log_probs == pytest.approx(samples[0].log_probs, abs=1e-5)
    assert isinstance(too_long, Exception) and "maximum context length is 128" in str(too_long)
    assert len(fine[0]) == 3  # the refused request failed alone
    assert front.requests == 8 and front.busy_s > 0


def test_closing_a_hosted_front_mid_call_cancels_its_callers_and_the_engine_serves_on(hosted):
    async def go():
        front = serving(hosted)
        pending = [asyncio.ensure_future(front.generate(p, SamplingConfig(max_tokens=100, seed=i)))
                   for i, p in enumerate(PROMPTS)]
        while not front.calls:  # sent
            await asyncio.sleep(0.01)
        await front.close()
        return await asyncio.gather(*pending, return_exceptions=True)

    results = asyncio.run(go())
    assert all(isinstance(r, asyncio.CancelledError) for r in results)

    async def again():
        front = serving(hosted)
        try:
            return await front.generate(PROMPTS[0], SamplingConfig(max_tokens=5, seed=9))
        finally:
            await front.close()

    assert len(asyncio.run(again())[0]) == 5


def test_a_hosted_engine_cuts_its_requests_between_steps_and_the_cut_crosses_the_actor(hosted, engine):
    # Partial rollout in a disaggregated engine: the client's interrupt reaches the actor's own
    # front, which ends the running request after its current step; the caller gets the tokens
    # it had (the uncut run's prefix) through the actor's stream, and the engine serves again
    # after release. Steps slowed to 20 ms in the actor, so the cut lands mid-decode.
    import ray

    def slow_steps(host, delay_s: float):
        """In the engine's actor: every engine step takes `delay_s` longer and is counted in
        `host.slow_steps` (0: as it was)."""
        import time

        if delay_s == 0:
            host.engine.__dict__.pop("step", None)
            return
        step = type(host.engine).step
        host.slow_steps = 0

        def slow():
            time.sleep(delay_s)
            host.slow_steps += 1
            return step(host.engine)

        host.engine.step = slow

    def slow_steps_made(host) -> int:
        return host.slow_steps

    config = SamplingConfig(temperature=1.0, max_tokens=100)
    [[reference]] = engine.generate([PROMPTS[0]], config, seeds=[21])
    assert len(reference.token_ids) == 100

    async def go():
        front = serving(hosted)
        try:
            running = asyncio.ensure_future(front.generate(PROMPTS[0], replace(config, seed=21)))
            while await hosted.actor.__ray_call__.remote(slow_steps_made) < 3:
                await asyncio.sleep(0.01)
            await front.interrupt()
            cut = await asyncio.gather(running, return_exceptions=True)
            held = await asyncio.gather(front.generate(PROMPTS[1], SamplingConfig(max_tokens=3)), return_exceptions=True)
            await front.release()
            return cut[0], held[0], await front.generate(PROMPTS[1], SamplingConfig(max_tokens=3, seed=4))
        finally:
            await front.close()

    ray.get(hosted.actor.__ray_call__.remote(slow_steps, 0.02))
    try:
        cut, held, after = asyncio.run(go())
    finally:
        ray.get(hosted.actor.__ray_call__.remote(slow_steps, 0))
    assert isinstance(cut, GenerationInterrupted), cut
    assert 3 <= len(cut.token_ids) < 100 and cut.token_ids == reference.token_ids[:len(cut.token_ids)]
    assert cut.log_probs == pytest.approx(reference.log_probs[:len(cut.token_ids)], abs=1e-5)
    assert isinstance(held, GenerationInterrupted) and held.token_ids == []
    assert len(after[0]) == 3
