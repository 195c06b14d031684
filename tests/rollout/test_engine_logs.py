"""vLLM's per-sync chatter is dropped; its other warnings are kept."""
import logging

from rlfactory_megatron.rollout.engines import _DropRotaryReloadWarning


def _record(msg, *args, level=logging.WARNING):
    return logging.LogRecord("vllm.model_executor.model_loader.reload.layerwise", level, __file__, 1, msg, args, None)


def test_only_the_rotary_reload_warning_is_dropped():
    keep = _DropRotaryReloadWarning().filter
    assert not keep(_record("%s: Failed to load weights", "RotaryEmbedding"))
    assert not keep(_record("%s: Failed to load weights", "Llama3RotaryEmbedding"))
    assert keep(_record("%s: Failed to load weights", "QKVParallelLinear"))  # a real weight missing: shown
    assert keep(_record("%s: Delayed processing", "RotaryEmbedding", level=logging.DEBUG))
