"""Per-request seeds: a seeded sample is a function of its prompt, weights and seed only — not of
which other requests share its engine call — and differently seeded requests still share one call."""
import asyncio
import os
from dataclasses import replace

import pytest

from rlfactory_megatron.rollout.engines import SamplingConfig
from rlfactory_megatron.rollout.fronts import BatchingFront

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tiny_hf_dirs):
    from rlfactory_megatron.rollout.engines import VLLMEngine

    engine = VLLMEngine(tiny_hf_dirs["qwen3"], max_model_len=256, max_num_seqs=64)
    yield engine
    engine.close()


def test_seeded_samples_do_not_depend_on_their_batch(engine):
    prompts = [[5, 17, 42, 8], [9, 9, 31], [100, 3, 77, 12, 6], [5, 17, 42, 8]]
    config = SamplingConfig(temperature=1.0, max_tokens=12)

    async def go():
        adapter = BatchingFront(engine, window_s=0.05)
        try:
            alone = await adapter.generate(prompts[0], replace(config, seed=11))
            start = adapter.batches
            together = await asyncio.gather(*(adapter.generate(p, replace(config, seed=seed))
                                              for p, seed in zip(prompts, (3, 4, 5, 11))))
            return alone, together, adapter.batches - start
        finally:
            await adapter.close()

    alone, together, batches = asyncio.run(go())
    # Many seeded requests at once: more prompt tokens than one engine step takes.
    long_prompts = [[(7 * i + j) % 400 + 10 for j in range(200)] for i in range(48)]
    crowd = engine.generate(long_prompts, config, seeds=list(range(48)))
    assert [len(g[0].token_ids) for g in crowd] == [12] * 48
    assert batches == 1  # different seeds do not split the batch
    assert together[3][0] == alone[0] and together[3][1] == pytest.approx(alone[1], abs=1e-5)
    assert together[0][0] != alone[0]  # same prompt, another seed: another sample (random weights, T=1)
    # On CPU the engine compiles nothing (its sampler's torch.compile cost 1-4 CPU-s per engine process)
    from torch._dynamo.utils import counters

    assert not counters["stats"]["unique_graphs"], dict(counters["stats"])


def test_minor_batch_invariant_needs_compute_capability_8(monkeypatch):
    # Issue 53 item 12: vLLM 0.32's batch-invariant kernels cover compute capability 8.x (its
    # Triton matmuls) and 9.0 and up; a GPU below is refused when the engine starts, by name.
    import torch

    from rlfactory_megatron.rollout import engines

    for variable in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_BATCH_INVARIANT"):
        monkeypatch.setenv(variable, os.environ.get(variable, ""))  # the engine sets them: restored after
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"^rollout.batch_invariant=true needs a GPU of compute capability >= 8.0 "
                                         r"\(vLLM's batch-invariant kernels\), and Tesla T4 is 7.5: set "
                                         r"rollout.batch_invariant=false$"):
        engines.VLLMEngine("no-model", batch_invariant=True)
    for ampere_and_up in ((8, 0), (8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=ampere_and_up: c)
        engines._check_batch_invariant_device()
