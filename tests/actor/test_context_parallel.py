"""Context parallelism (parallel.cp): packed multi-turn micro-batches (tool tokens masked) split
over a CP group of 2 give the logits, log-probs, entropy, values, losses and gradients of CP=1,
at tp=1 and tp=2 (tp=2 x cp=2: 4 ranks)."""

import pytest

import actor_workers

from rlfactory_megatron.runtime.distributed import spawn_local_workers

# fp32: the CP group sums attention over two key ranges and the gradients over two ranks, in
# another order than one rank does; everything else is the same arithmetic.
TOL = 1e-6


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


# The gradients are compared whole under DDP's all-reduce; with the distributed optimizer (the
# default, sharded over dp x cp) a rank's gradients are reduced in its shard only, so there the
# grad norms (summed over the shards) and everything else are compared.
@pytest.mark.parametrize("tp,distributed_optimizer", [(1, False), (2, False), (1, True)])
def test_cp2_gives_the_logits_values_and_gradients_of_cp1(tiny_hf_dirs, tp, distributed_optimizer):
    alone = spawn_local_workers(actor_workers.context_parallel_worker, tp, tiny_hf_dirs["qwen3"], tp, 1,
                                distributed_optimizer)
    split = spawn_local_workers(actor_workers.context_parallel_worker, 2 * tp, tiny_hf_dirs["qwen3"], tp, 2,
                                distributed_optimizer)
    # megatron's rank order is tp-cp-dp-pp: rank t holds TP shard t at CP rank 0, rank t + tp at CP rank 1.
    for rank, out in enumerate(split):
        ref = alone[rank % tp]
        assert out["logits"].abs().max() > 0.1 and _max_diff(out["logits"], ref["logits"]) <= TOL, rank
        for key in ("log_probs", "entropy", "values"):
            assert _max_diff(out[key], ref[key]) <= TOL, (rank, key)
        for key in ("actor_grads", "critic_grads") if not distributed_optimizer else ():
            assert sorted(out[key]) == sorted(ref[key])
            assert max(float(g.abs().max()) for g in ref[key].values()) > 1e-2  # gradients worth comparing
            for name, grad in ref[key].items():
                assert _max_diff(out[key][name], grad) <= TOL, (rank, key, name)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/clip_frac", "actor/grad_norm"):
            assert out["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-6, abs=TOL), (rank, key)
        for key in ("critic/vf_loss", "critic/grad_norm"):
            assert out["critic_metrics"][key] == pytest.approx(ref["critic_metrics"][key], rel=1e-6, abs=TOL), key
