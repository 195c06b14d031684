"""Rank body for the run-checkpoint tests (importable by spawned processes): log-probs of a run
checkpoint's actor three ways: Megatron from its distributed checkpoint, transformers and a vLLM
engine from its HF folder."""
from __future__ import annotations

from pathlib import Path

import torch


def log_probs_three_ways(checkpoint: str, initial_hf_dir: str,
                         rows: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """Largest |difference| to Megatron's log-probs of every token after the first, over `rows`
    (prompt ids, response ids): transformers' and vLLM's from the checkpoint's `hf/` folder, and
    (how far training moved them) transformers' from the run's initial model. fp32, untempered;
    Megatron at tp=1 from the checkpoint the run wrote at its own layout."""
    from rlfactory_megatron.actor.actor import PolicyModel
    from rlfactory_megatron.models.builder import BuildOptions
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed
    from rlfactory_megatron.actor.batch import pad_rows

    hf_dir = Path(checkpoint) / "hf"
    sequences = [prompt + response for prompt, response in rows]
    batch = pad_rows(sequences, [[1] * len(seq) for seq in sequences])
    init_distributed(ParallelSizes(1, 1))
    try:
        model = PolicyModel(load_arch(hf_dir), None, BuildOptions(), max_tokens=4096)
        model.megatron.load(Path(checkpoint) / "actor")
        megatron = model.compute_log_probs(batch)["log_probs"]
    finally:
        destroy_distributed()
    expected = [megatron[row, 1:len(seq)] for row, seq in enumerate(sequences)]
    report = {"tokens": sum(len(seq) - 1 for seq in sequences)}
    for name, ours in (("transformers", _transformers(hf_dir, sequences)), ("vllm", _vllm(hf_dir, sequences)),
                       ("initial", _transformers(Path(initial_hf_dir), sequences))):
        report[name] = max(float((mine - theirs).abs().max()) for mine, theirs in zip(ours, expected))
    return report


def _transformers(hf_dir: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            log_probs = model(ids).logits[0, :-1].log_softmax(-1)
            out.append(log_probs.gather(-1, ids[0, 1:, None])[:, 0])
    return out


def _vllm(hf_dir: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The log-prob vLLM gives each prompt token (prompt_logprobs), each whole sequence its prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rlfactory_megatron.rollout.engines import VLLMEngine

    engine = VLLMEngine(str(hf_dir), max_model_len=max(len(seq) for seq in sequences) + 8, max_num_seqs=8)
    try:
        outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=seq) for seq in sequences],
                                      SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
    finally:
        engine.close()
    return [torch.tensor([output.prompt_logprobs[t][seq[t]].logprob for t in range(1, len(seq))])
            for output, seq in zip(outputs, sequences)]
