"""Fault injection and recording for the tests that put this folder on PYTHONPATH (every process
of the run, Ray's engine actors included, imports it at start-up). Inert unless a variable below
is set; each patches a module of ours right after it is imported.

RLF_TEST_KILL_ENGINE_MID_SYNC="<actor name>:<sync>:<bucket>": the engine actor of that name exits
(as a crashed process does) when it is about to receive that bucket (1-based) of its that-th
weight sync: an engine lost in the middle of a sync, at a point no timing decides.

RLF_TEST_RECORD_DEVICE_PHASES=<file>: what a GPU's memory hand-over between training and the
engines depends on is written to <file>, one JSON object per line, in order: every engine
sleep (its level) and wake-up (its tags), the first and the last bucket of each weight load,
every megatron pass (training or forward only), every offload (its kinds) and every
torch.cuda.empty_cache(). vLLM's sleep mode itself runs on GPU only; the calls are what a CPU
run can show.

RLF_TEST_PERTURB_ENGINE_ROUTES=<layer>: a test seam, not a behaviour: in engines that record their
routes (R3), that MoE layer's router sends each token to the next experts (expert e -> e + 1), so
the engine's routes differ from the trainer's own router's there, and weights them as the router
weights the experts it picks (Qwen3-MoE: softmax over their logits), so a trainer replaying them
computes what the engine did.
"""
import json
import os
import sys

_KILL_SPEC = os.environ.get("RLF_TEST_KILL_ENGINE_MID_SYNC")
_RECORD = os.environ.get("RLF_TEST_RECORD_DEVICE_PHASES")
_PERTURB_LAYER = os.environ.get("RLF_TEST_PERTURB_ENGINE_ROUTES")


def _kill_mid_sync(module) -> None:
    host = module.VLLMEngineHost
    name, sync, bucket = _KILL_SPEC.rsplit(":", 2)
    sync, bucket = int(sync), int(bucket)
    count = {"syncs": 0, "buckets": 0}
    receive, finish = host.receive_bucket, host.finish_weight_update

    def receive_or_exit(self, layout):
        import ray

        count["buckets"] += 1
        if (count["syncs"] + 1, count["buckets"]) == (sync, bucket) and ray.get_runtime_context().get_actor_name() == name:
            os._exit(1)
        return receive(self, layout)

    def finish_counting(self):
        count["syncs"] += 1
        count["buckets"] = 0
        return finish(self)

    host.receive_bucket, host.finish_weight_update = receive_or_exit, finish_counting


def _record(event: str, **fields) -> None:
    with open(_RECORD, "a") as out:
        out.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")


def _wrap(cls, name: str, before) -> None:
    """cls.name records `before(args, kwargs)`'s event, then runs as it did."""
    original = getattr(cls, name)

    def recorded(self, *args, **kwargs):
        before(self, args, kwargs)
        return original(self, *args, **kwargs)

    setattr(cls, name, recorded)


def _record_engine(module) -> None:
    engine = module.VLLMEngine
    _wrap(engine, "sleep", lambda self, a, k: _record("sleep", level=(a[0] if a else k.get("level"))))
    _wrap(engine, "wake_up", lambda self, a, k: _record("wake_up", tags=(a[0] if a else k.get("tags"))))

    def load(self, a, k):
        if not getattr(self, "_recorded_load", False):
            self._recorded_load = True
            _record("load")

    def loaded(self, a, k):
        self._recorded_load = False
        _record("loaded")

    _wrap(engine, "load_weights", load)
    _wrap(engine, "finish_weight_update", loaded)


def _record_training(module) -> None:
    import torch

    def forward_only(a, k) -> bool:
        return bool(a[2] if len(a) > 2 else k.get("forward_only"))

    _wrap(module.MegatronModel, "run", lambda self, a, k: _record("run", train=not forward_only(a, k)))
    empty_cache = torch.cuda.empty_cache

    def recorded_empty_cache():
        _record("empty_cache")
        empty_cache()

    torch.cuda.empty_cache = recorded_empty_cache


def _record_offload(module) -> None:
    _wrap(module.HostOffload, "offload", lambda self, a, k: _record("offload", kinds=sorted(a[0] if a else k["kinds"])))


def _perturb_engine_routes(module) -> None:
    hook = module.hook_routers

    def hook_and_perturb(model, capture):
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        hook(model, capture)
        for runner in model.modules():
            if isinstance(runner, MoERunner) and runner.layer_id == int(_PERTURB_LAYER):
                router, compute = runner.router, runner.router._compute_routing

                def next_experts(hidden_states, router_logits, indices_type, *, input_ids=None,
                                 router=router, compute=compute):
                    weights, ids = compute(hidden_states, router_logits, indices_type, input_ids=input_ids)
                    ids = (ids + 1) % router.global_num_experts
                    return router_logits.float().gather(1, ids.long()).softmax(-1).to(weights.dtype), ids

                router._compute_routing = next_experts

    module.hook_routers = hook_and_perturb


_PATCHES = {}
if _KILL_SPEC:
    _PATCHES["rlfactory_megatron.rollout.ray_engine"] = [_kill_mid_sync]
if _PERTURB_LAYER:
    _PATCHES["rlfactory_megatron.rollout.engine_routes"] = [_perturb_engine_routes]
if _RECORD:
    _PATCHES.setdefault("rlfactory_megatron.rollout.engines", []).append(_record_engine)
    _PATCHES.setdefault("rlfactory_megatron.actor.model", []).append(_record_training)
    _PATCHES.setdefault("rlfactory_megatron.actor.offload", []).append(_record_offload)

if _PATCHES:
    import importlib.abc
    import importlib.util

    class _PatchAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in _PATCHES:
                return None
            patches = _PATCHES.pop(fullname)
            sys.meta_path.remove(self)  # the module's own spec, found without this finder
            try:
                spec = importlib.util.find_spec(fullname)
            finally:
                if _PATCHES:
                    sys.meta_path.insert(0, self)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                for patch in patches:
                    patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchAfterImport())
