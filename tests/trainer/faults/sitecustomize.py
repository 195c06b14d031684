"""Fault injection for the tests that put this folder on PYTHONPATH (every process of the run,
Ray's engine actors included, imports it at start-up). Inert unless the variable below is set.

RLF_TEST_KILL_ENGINE_MID_SYNC="<actor name>:<sync>:<bucket>": the engine actor of that name exits
(as a crashed process does) when it is about to receive that bucket (1-based) of its that-th
weight sync: an engine lost in the middle of a sync, at a point no timing decides."""
import os
import sys

_SPEC = os.environ.get("RLF_TEST_KILL_ENGINE_MID_SYNC")
_MODULE = "rlfactory_megatron.rollout.ray_engine"


def _patch(host) -> None:
    name, sync, bucket = _SPEC.rsplit(":", 2)
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


if _SPEC:
    import importlib.abc
    import importlib.util

    class _PatchAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != _MODULE:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                _patch(module.VLLMEngineHost)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchAfterImport())
