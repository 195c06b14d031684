"""actor.use_fused_logprob: the fused log-prob kernel gives the actor the same log-probs, entropy and update as
megatron's vocab-parallel logits path, with megatron's padded vocab (qwen2) and tied embeddings (qwen3),
and checkpoints do not depend on the switch."""

import pytest
import torch

import actor_workers

from rlfactory_megatron.runtime.distributed import spawn_local_workers


def run(hf_dir: str, tp: int, fused: bool, checkpoint: str | None = None, resume_from: str | None = None) -> dict:
    return spawn_local_workers(actor_workers.update_worker, tp, hf_dir, tp, 1, {"actor.use_fused_logprob": fused},
                               False, checkpoint, resume_from)[0]


def assert_same_weights(a: dict, b: dict) -> None:
    assert sorted(a["weights"]) == sorted(b["weights"])
    for name, tensor in a["weights"].items():
        torch.testing.assert_close(tensor, b["weights"][name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", ["qwen2", "qwen3"])
def test_fused_and_vocab_parallel_paths_agree(tiny_hf_dirs, model, tp):
    fused, plain = run(tiny_hf_dirs[model], tp, True), run(tiny_hf_dirs[model], tp, False)
    for key in ("old_log_probs", "entropy"):
        torch.testing.assert_close(fused[key], plain[key], atol=1e-5, rtol=0)
    # Not bit-identical: the two switch values really ran different code (fp64 stats vs fp32 logits).
    assert not torch.equal(fused["old_log_probs"], plain["old_log_probs"])
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert fused["metrics"][key] == pytest.approx(plain["metrics"][key], abs=1e-5, rel=1e-5), key
    assert_same_weights(fused, plain)


@pytest.mark.slow
def test_checkpoint_saved_fused_resumes_unfused(tiny_hf_dirs, tmp_path):
    # The hidden-states output layer keeps output_layer.weight's name and TP sharding, so the switch
    # can change across a resume: update, save, update (fused) == load, update (unfused).
    ckpt = str(tmp_path / "ckpt")
    uninterrupted = run(tiny_hf_dirs["qwen2"], 2, True, checkpoint=ckpt)
    resumed = run(tiny_hf_dirs["qwen2"], 2, False, resume_from=ckpt)
    assert_same_weights(uninterrupted, resumed)
