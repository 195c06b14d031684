"""vLLM's per-sync chatter is dropped; its other warnings are kept."""
import logging

from rlfactory_megatron.rollout.engines import _DropExpectedReloadWarnings


def _record(msg, *args, level=logging.WARNING):
    return logging.LogRecord("vllm.model_executor.model_loader.reload.layerwise", level, __file__, 1, msg, args, None)


def test_only_the_expected_reload_warnings_are_dropped():
    keep = _DropExpectedReloadWarnings().filter
    assert not keep(_record("%s: Failed to load weights", "RotaryEmbedding"))
    assert not keep(_record("%s: Failed to load weights", "Llama3RotaryEmbedding"))
    assert not keep(_record("%s: Failed to load weights", "ParallelLMHead"))  # tied: re-processed by us
    assert keep(_record("%s: Failed to load weights", "QKVParallelLinear"))  # a real weight missing: shown
    assert keep(_record("%s: Delayed processing", "RotaryEmbedding", level=logging.DEBUG))
