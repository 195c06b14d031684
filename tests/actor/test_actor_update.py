"""PPO updates of the Megatron actor: identical across TP/PP/DP splits, micro-batch cuts, masks and resumes."""

import pytest
import torch

import actor_workers
from toy_rows import random_batch

from rlfactory_megatron.runtime.distributed import spawn_local_workers


def run(hf_dir, tp=1, pp=1, dp=1, overrides=None, cp=1, ep=1, **kw):
    # ep splits the experts among data-parallel ranks: it is a part of dp, not a factor of the world
    return spawn_local_workers(actor_workers.update_worker, tp * pp * dp * cp, hf_dir, tp, pp, overrides or {},
                               kw.get("perturb_masked", False), kw.get("checkpoint"), kw.get("resume_from"),
                               kw.get("layer_spec", "auto"), cp, ep)


def assert_same_update(a, b, tol=1e-5):
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert abs(a["metrics"][key] - b["metrics"][key]) <= tol * max(1.0, abs(a["metrics"][key])), key
    assert sorted(a["weights"]) == sorted(b["weights"])
    for name, tensor in a["weights"].items():
        assert (tensor - b["weights"][name]).abs().max() <= tol, name


@pytest.fixture(scope="module")
def reference(tiny_hf_dirs):
    return run(tiny_hf_dirs["qwen3"])[0]


def test_update_changes_weights_and_reports_metrics(reference, tiny_hf_dirs):
    from rlfactory_megatron.models.hf_checkpoint import iter_safetensors

    before = dict(iter_safetensors(tiny_hf_dirs["qwen3"]))
    moved = max((reference["weights"][k] - v).abs().max().item() for k, v in before.items())
    assert moved > 1e-4
    m = reference["metrics"]
    assert m["actor/tokens_per_s"] > 0 and m["actor/grad_norm"] > 0 and 0 <= m["actor/clip_frac"] <= 1


@pytest.mark.parametrize("tp,pp,dp,cp", [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (2, 2, 1, 1), (1, 1, 1, 2),
                                         (1, 2, 1, 2)])
def test_update_is_the_same_at_every_layout(reference, tiny_hf_dirs, tp, pp, dp, cp):
    results = run(tiny_hf_dirs["qwen3"], tp, pp, dp, cp=cp)
    assert_same_update(reference, results[0])
    for r in results:  # every rank ends with the same metrics and old log-probs
        assert r["metrics"]["actor/pg_loss"] == pytest.approx(results[0]["metrics"]["actor/pg_loss"], abs=1e-6)
        assert torch.allclose(r["old_log_probs"], reference["old_log_probs"], atol=1e-5)


def test_moe_update_with_experts_split_over_two_ranks_equals_one_rank(tiny_hf_dirs):
    # Two data-parallel ranks, each holding 4 of the 8 experts (tokens travel to their experts by
    # all-gather on gloo), make the update one rank holding every expert makes.
    alone = run(tiny_hf_dirs["qwen3_moe"])[0]
    split = run(tiny_hf_dirs["qwen3_moe"], dp=2, ep=2)
    assert [r["expert_weights"] for r in split] == [alone["expert_weights"] // 2] * 2 == [4 * 4 * 2] * 2
    # What the memory plan counts on a rank (experts / ep of each layer) is what megatron built there.
    from rlfactory_megatron.models.hf_arch import load_arch

    arch = load_arch(tiny_hf_dirs["qwen3_moe"])
    assert [r["parameters"] for r in split] == [arch.parameter_count(ep=2)] * 2
    assert alone["parameters"] == arch.parameter_count()
    assert_same_update(alone, split[0])
    for r in split:
        assert torch.allclose(r["old_log_probs"], alone["old_log_probs"], atol=1e-5)

    # model.moe: a frozen router keeps its weights while the experts move; the balancing loss
    # (on here, off by default) changes the update.
    from rlfactory_megatron.models.hf_checkpoint import iter_safetensors

    keys = {"model.moe.freeze_router": True, "model.moe.load_balancing": "aux_loss", "model.moe.aux_loss_coeff": 0.1}
    balanced = run(tiny_hf_dirs["qwen3_moe"], overrides=keys)[0]
    frozen = balanced["weights"]
    before = dict(iter_safetensors(tiny_hf_dirs["qwen3_moe"]))
    routers = [name for name in before if name.endswith("mlp.gate.weight")]
    assert len(routers) == 4 and all(torch.equal(frozen[name], before[name]) for name in routers)
    assert not all(torch.equal(alone["weights"][name], before[name]) for name in routers)
    expert = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert not torch.equal(frozen[expert], before[expert]) and not torch.equal(frozen[expert], alone["weights"][expert])
    # The update's MoE metrics: each layer's expert load (max / mean tokens per expert, the same
    # at ep 2), the balancing loss where there is one (~1 for a router spreading tokens evenly).
    for layer in range(4):
        key = f"moe/load_imbalance/layer{layer}"
        assert alone["metrics"][key] > 1 and split[0]["metrics"][key] == pytest.approx(alone["metrics"][key])
    assert "moe/aux_loss" not in alone["metrics"] and "moe/routing_agreement" not in alone["metrics"]
    assert 0.5 < balanced["metrics"]["moe/aux_loss"] < 4


def test_routing_replay_replays_the_recorded_routes_at_pp2_with_recompute_and_ep2(tiny_hf_dirs):
    # actor.moe.routing_replay=R2: the update's forwards take the routes the old-log-prob pass took.
    # One stage with megatron's masked attention (packs of any cut give the same bits), two with
    # THD attention (local_sdpa; the default on CPU and the path of Transformer-Engine's).
    one = spawn_local_workers(actor_workers.routing_replay_worker, 1, tiny_hf_dirs["qwen3_moe"], 1, False, 3,
                              "local")[0]
    rec = one["recorded"]
    assert rec["routes"].dtype == torch.int16 and rec["routes"].shape[2:] == (4, 2)
    # Aligned like the log-probs: at token t, the routes of the position predicting it (1 <= t < length).
    t, lengths = torch.arange(rec["routes"].shape[1])[None], torch.tensor([10 + 3 * i for i in range(6)])[:, None]
    recorded = (rec["routes"] >= 0).all(-1).all(-1)
    assert torch.equal(recorded, (t >= 1) & (t < lengths))
    # Before the first optimizer step, the update's forward is the old-log-prob pass's, exactly.
    first = slice(0, 3)  # the first of 2 mini-batches
    assert torch.equal(rec["update_log_probs"][first], rec["old_log_probs"][first])
    # The update's own routers agree with the recorded routes on the first mini-batch, less after
    # its optimizer step (0.80 measured over both).
    assert 0.5 < rec["metrics"]["moe/routing_agreement"] < 1
    assert all(rec["metrics"][f"moe/load_imbalance/layer{layer}"] >= 1 for layer in range(4))
    # Replayed routes no router chose: the update follows them (its router never agrees) ...
    shifted = one["shifted"]
    assert shifted["metrics"]["moe/routing_agreement"] < 0.05
    assert (shifted["update_log_probs"] - rec["update_log_probs"]).abs().max() > 1e-2
    # ... and two pipeline stages that recompute every layer in the backward replay each
    # micro-batch's own routes: the same log-probs and update as one stage (a replay that took the
    # routes of the micro-batch run last, not the one recomputed, was 1.5e-2 off here).
    two = spawn_local_workers(actor_workers.routing_replay_worker, 2, tiny_hf_dirs["qwen3_moe"], 2, True)[0]
    # So do 2 data-parallel ranks holding 4 experts each (every rank gets every row's routes).
    split = spawn_local_workers(actor_workers.routing_replay_worker, 2, tiny_hf_dirs["qwen3_moe"], 1, False, 3,
                                "auto", 2)
    for other in (two, *split):
        for name in ("recorded", "shifted"):
            assert torch.equal(other[name]["routes"], one[name]["routes"]), name
            assert torch.allclose(other[name]["update_log_probs"], one[name]["update_log_probs"], atol=1e-5), name
            for key in ("actor/pg_loss", "actor/grad_norm", "moe/routing_agreement"):
                assert other[name]["metrics"][key] == pytest.approx(one[name]["metrics"][key], abs=1e-5), (name, key)


@pytest.mark.parametrize("mini_batch_size", [6, 3, 1])
def test_dp_ranks_holding_only_their_rows_make_the_same_update(tiny_hf_dirs, mini_batch_size):
    # The trainer hands each DP rank only the rows it trains on; log-probs and update equal those
    # of one rank holding the whole batch (3 rows per mini-batch: 1 or 2 rows per DP rank; 1 row:
    # DP rank 1 holds none at all, and still takes part in every optimizer step).
    reference = run(tiny_hf_dirs["qwen3"], overrides={"actor.mini_batch_size": mini_batch_size})[0]
    results = spawn_local_workers(actor_workers.dp_local_update_worker, 2, tiny_hf_dirs["qwen3"], mini_batch_size)
    assert sorted(results[0]["rows"] + results[1]["rows"]) == list(range(6))
    assert all(r["rows"] for r in results) == (mini_batch_size > 1)
    assert_same_update(reference, results[0])
    for r in results:
        width = r["old_log_probs"].shape[1]
        assert torch.allclose(r["old_log_probs"], reference["old_log_probs"][r["rows"], :width], atol=1e-5)
        assert r["metrics"]["actor/pg_loss"] == pytest.approx(reference["metrics"]["actor/pg_loss"], abs=1e-5)


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)])
def test_on_policy_update_needs_no_separate_log_prob_pass(tiny_hf_dirs, tp, pp):
    # One optimizer step over the whole batch: old log-probs from the update's own forward give the
    # same step as a separate pass (ratio 1), and the same entropy.
    out = spawn_local_workers(actor_workers.on_policy_worker, tp * pp, tiny_hf_dirs["qwen3"], tp, pp, 6)[0]
    assert out["on_policy"]
    a, b = out["separate_pass"], out["own_forward"]
    assert a["metrics"]["actor/grad_norm"] > 0
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/clip_frac"):
        assert b["metrics"][key] == pytest.approx(a["metrics"][key], abs=1e-6), key
    for name, tensor in a["weights"].items():
        assert (tensor - b["weights"][name]).abs().max() <= 1e-6, name
    assert b["metrics"]["actor/entropy"] == pytest.approx(out["entropy_old"], rel=1e-5)
    # The on-policy update keeps the log-probs of its own forward: those of the separate pass.
    assert torch.allclose(b["update_log_probs"], out["old_log_probs"], atol=1e-6)
    # A token IS correction inside the on-policy update (no separate pass) makes the step that
    # weighting the advantages after a separate pass makes.
    before, inside = out["tis_before_update"], out["tis_in_update"]
    assert before["metrics"]["actor/grad_norm"] != pytest.approx(a["metrics"]["actor/grad_norm"], rel=1e-3)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/clip_frac"):
        assert inside["metrics"][key] == pytest.approx(before["metrics"][key], abs=1e-6), key
    for name, tensor in before["weights"].items():
        assert (tensor - inside["weights"][name]).abs().max() <= 1e-6, name


def test_update_without_old_log_probs_is_refused_when_it_takes_several_steps(tiny_hf_dirs):
    out = spawn_local_workers(actor_workers.on_policy_worker, 1, tiny_hf_dirs["qwen3"], 1, 1, 3)[0]
    assert not out["on_policy"] and "weights" in out["separate_pass"]
    assert "actor.mini_batch_size=3" in out["own_forward"]["error"]


def test_sft_step_trains_the_untempered_distribution(tiny_hf_dirs):
    # An actor whose RL log-probs are at rollout.temperature 0.6 still fits demonstrations at 1.0.
    out = spawn_local_workers(actor_workers.sft_worker, 1, tiny_hf_dirs["qwen3"], 0.6)[0]
    assert out["sft_loss"] == pytest.approx(out["nll_t1"], rel=1e-5)
    assert abs(out["nll_tempered"] - out["nll_t1"]) > 1e-2


def test_masked_tokens_contribute_nothing(reference, tiny_hf_dirs):
    perturbed = run(tiny_hf_dirs["qwen3"], perturb_masked=True)[0]
    assert_same_update(reference, perturbed, tol=1e-6)


def test_block_mask_spec_gives_the_same_update_as_thd(reference, tiny_hf_dirs):
    # megatron's plain local spec takes the packed micro-batch's block-diagonal mask (built on
    # demand); the reference runs the THD path (cu_seqlens, no mask).
    masked = run(tiny_hf_dirs["qwen3"], layer_spec="local")[0]
    assert_same_update(reference, masked)


def test_micro_batch_cuts_do_not_change_the_update(reference, tiny_hf_dirs):
    # One big micro-batch of everything vs the reference's 64-token budget (several packed cuts).
    whole = run(tiny_hf_dirs["qwen3"], overrides={"actor.max_tokens_per_microbatch": 4096})[0]
    assert_same_update(reference, whole)


def test_save_load_then_next_update_is_bit_identical(tiny_hf_dirs, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    uninterrupted = run(tiny_hf_dirs["qwen3"], checkpoint=ckpt)[0]  # update, save, update
    resumed = run(tiny_hf_dirs["qwen3"], resume_from=ckpt)[0]  # fresh process: load, update
    for name, tensor in uninterrupted["weights"].items():
        assert torch.equal(tensor, resumed["weights"][name]), name
    assert uninterrupted["metrics"]["actor/pg_loss"] == resumed["metrics"]["actor/pg_loss"]


def test_item10_distributed_optimizer_runs_on_gloo_and_resumes_exactly(reference, tiny_hf_dirs, tmp_path):
    # actor.optim.use_distributed_optimizer (on by default) shards Adam's state across DP ranks
    # (reduce-scatter and all-gather on gloo); its checkpoint resumes bit-identically.
    # Two optimizer steps per update: a step count of 2 to restore (torch Adam's is a tensor per
    # parameter, which megatron's load left at that of a fresh state).
    ckpt, steps = str(tmp_path / "ckpt"), {"actor.mini_batch_size": 3}
    uninterrupted = run(tiny_hf_dirs["qwen3"], dp=2, overrides=steps, checkpoint=ckpt)  # update, save, update
    resumed = run(tiny_hf_dirs["qwen3"], dp=2, overrides=steps, resume_from=ckpt)  # fresh processes: load, update
    assert {r["optimizer"] for r in uninterrupted + resumed} == {"DistributedOptimizer"}
    for name, tensor in uninterrupted[0]["weights"].items():
        assert torch.equal(tensor, resumed[0]["weights"][name]), name
    assert uninterrupted[0]["metrics"]["actor/pg_loss"] == resumed[0]["metrics"]["actor/pg_loss"]
    # The reference (and every layout above) runs it too; megatron's plain optimizer gives the same update.
    plain = run(tiny_hf_dirs["qwen3"], overrides={"actor.optim.use_distributed_optimizer": False})[0]
    assert reference["optimizer"] == "DistributedOptimizer" and plain["optimizer"] != "DistributedOptimizer"
    assert_same_update(reference, plain, tol=1e-6)


def test_packed_log_probs_and_entropy_equal_transformers_per_sequence(reference, tiny_hf_dirs):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dirs["qwen3"], dtype=torch.float32)
    batch = random_batch(model.config.vocab_size)
    for row, n in enumerate(batch.lengths.tolist()):
        with torch.no_grad():
            logits = model(batch.input_ids[row : row + 1, :n]).logits[0, :-1]
        log_softmax = torch.log_softmax(logits, -1)
        expected_lp = log_softmax.gather(-1, batch.input_ids[row, 1:n, None])[:, 0]
        expected_h = -(log_softmax.exp() * log_softmax).sum(-1)
        mask = batch.loss_mask[row, 1:n] > 0
        assert torch.allclose(reference["old_log_probs"][row, 1:n][mask], expected_lp[mask], atol=1e-4)
        assert torch.allclose(reference["entropy"][row, 1:n][mask], expected_h[mask], atol=1e-4)
        assert torch.all(reference["old_log_probs"][row, 1:n][~mask] == 0)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1)])
def test_critic_values_and_update(tiny_hf_dirs, tp, pp):
    results = spawn_local_workers(actor_workers.critic_worker, tp * pp, tiny_hf_dirs["llama"], tp, pp)
    first = results[0]
    mask = random_batch(500).loss_mask > 0
    assert torch.all(first["values"][~mask] == 0) and first["values"][mask].abs().sum() > 0
    assert first["metrics"]["critic/vf_loss"] > 0
    # the update moves values toward the returns
    returns = torch.randn(first["values"].shape, generator=torch.Generator().manual_seed(3))
    before = ((first["values"] - returns)[mask] ** 2).mean()
    after = ((first["after"] - returns)[mask] ** 2).mean()
    assert after < before
    for r in results:
        assert torch.allclose(r["values"], first["values"], atol=1e-6)


@pytest.mark.parametrize("poison,tp,pp", [("advantage", 1, 1), ("old_log_prob", 1, 2), ("advantage", 2, 1)])
def test_non_finite_update_is_skipped_on_every_rank(tiny_hf_dirs, poison, tp, pp):
    results = spawn_local_workers(actor_workers.non_finite_worker, tp * pp, tiny_hf_dirs["qwen3"], tp, pp, poison)
    for out in results:
        assert out["skipped"] == 1 and out["unchanged"] and out["in_a_row"] == 1 and out["lr_kept"]
        assert out["taken"] == 0 and out["moved"] > 1e-5 and out["reset"] == 0
        assert "non-finite weights found before the weight sync" in out["refused"] or "another rank" in out["refused"]


def test_item5_critic_with_sequence_parallel_gives_the_values_and_update_it_gives_without(tiny_hf_dirs):
    # With sequence parallelism the last layer's hidden states are split along the sequence across
    # the TP group: the value head must see the whole sequence, as megatron's output layer does.
    plain = spawn_local_workers(actor_workers.critic_worker, 2, tiny_hf_dirs["llama"], 2, 1, False)
    split = spawn_local_workers(actor_workers.critic_worker, 2, tiny_hf_dirs["llama"], 2, 1, True)
    for a, b in zip(plain, split):
        assert torch.allclose(b["values"], a["values"], atol=1e-6)
        assert b["metrics"]["critic/vf_loss"] == pytest.approx(a["metrics"]["critic/vf_loss"], abs=1e-6)
        assert torch.allclose(b["after"], a["after"], atol=1e-5)  # the same update


def test_item6_fp16_scales_the_loss_and_updates_as_float32_does(tiny_hf_dirs):
    # megatron's fp16 optimizer divides the gradients by its loss scale: the loss must have been
    # multiplied by it (config.grad_scale_func), or every update shrinks by the scale (2**32 in megatron).
    out = spawn_local_workers(actor_workers.loss_scale_worker, 1, tiny_hf_dirs["qwen3"])[0]
    fp32, fp16 = out["float32"], out["float16"]
    assert fp16["skipped"] == 0 and fp32["grad_norm"] > 1.0
    assert fp16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=1e-3)
    assert fp16["moved"] == pytest.approx(fp32["moved"], rel=0.05)
    assert fp16["loss_scale"] == 2.0**16 and fp32["loss_scale"] == 1.0  # torch.amp's start, not megatron's 2**32


def test_recompute_on_cpu_updates_as_without_it(tiny_hf_dirs):
    # megatron's recompute saves the CUDA generator's state to replay dropout: on CPU (cpu_compat)
    # that generator is the CPU one, whose state it saves too (it raised 'Torch not compiled with CUDA').
    out = spawn_local_workers(actor_workers.recompute_worker, 1, tiny_hf_dirs["qwen3"])[0]
    plain = out["none"]
    for mode in ("selective", "full"):  # model.recompute (issue 53 item 10)
        recomputed = out[mode]
        assert recomputed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6), mode
        assert recomputed["pg_loss"] == pytest.approx(plain["pg_loss"], rel=1e-6), mode
        for name, weight in plain["weights"].items():
            assert torch.allclose(recomputed["weights"][name], weight, rtol=0, atol=1e-6), (mode, name)
