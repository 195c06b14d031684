"""A Megatron model on this rank with its DDP wrapper, optimizer and LR schedule: the machinery
shared by the actor, the critic and the frozen reference model.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlfactory_megatron.actor.batch import MicroBatchPlan, PackedMicroBatch
from rlfactory_megatron.actor.offload import KINDS, HostOffload, megatron_state
from rlfactory_megatron.actor.routing import RoutePass, RouterTaps
from rlfactory_megatron.models.builder import BuildOptions, build_model_chunks, resolve_layer_spec
from rlfactory_megatron.models.conversion import iter_hf_tensors, load_hf_weights
from rlfactory_megatron.models.hf_arch import ModelArch
from rlfactory_megatron.models.pipeline import forward_backward
from rlfactory_megatron.runtime.cpu_compat import compute_device

# loss_fn(micro_batch, model_output) -> (loss, metrics); runs on the last pipeline stage.
MicroLossFn = Callable[[PackedMicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class NonFiniteError(RuntimeError):
    """Non-finite numbers where the run cannot go on: weights, or update after update."""


class MegatronModel:
    """Owns model chunks (+ DDP, optimizer, scheduler when trainable) and runs planned micro-batches."""

    def __init__(self, arch: ModelArch, hf_dir: str | None, build: BuildOptions, optim_cfg=None,
                 total_steps: int = 1) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        self.arch = arch
        self.trainable = optim_cfg is not None
        # Packed sequences go as cu_seqlens (THD) where the attention takes them; megatron's plain
        # local spec only takes a block-diagonal mask.
        self.thd_attention = resolve_layer_spec(build.layer_spec) in ("transformer_engine", "local_sdpa")
        chunks = build_model_chunks(arch, build)
        if hf_dir is not None:
            load_hf_weights(chunks, arch, hf_dir)
        # A MoE model's routes: recorded, replayed and counted per micro-batch (actor/routing.py).
        self.router_taps = (RouterTaps(chunks, arch.num_layers, arch.moe.num_experts, arch.moe.top_k)
                            if arch.moe is not None else None)
        self.optimizer = self.scheduler = None
        # Offloaded state comes back at the first use that needs it (run, train_step, modules,
        # sharded_state_dict), so no path can read a tensor that is away.
        self.host = HostOffload(lambda: megatron_state(self.chunks, self.optimizer))
        self._fixed_lr: float | None = None
        self.skipped_in_a_row = 0  # optimizer steps skipped for a non-finite loss or gradient, since the last one taken
        self.distributed_optimizer = False
        if not self.trainable:
            for chunk in chunks:
                chunk.requires_grad_(False)
                chunk.eval()
            self.chunks = chunks
            return
        self.distributed_optimizer = bool(optim_cfg.use_distributed_optimizer)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=self.distributed_optimizer
        )
        self.chunks = [
            DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
        config = self.chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = _build_optimizer(self.chunks, optim_cfg, self.distributed_optimizer)
        # As megatron's training loop sets it: the schedule scales each loss by the optimizer's
        # loss scale before backward (1 but in fp16, whose optimizer unscales the gradients by it).
        config.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = _build_scheduler(self.optimizer, optim_cfg, total_steps)

    # ------------------------------------------------------------------ running micro-batches
    def run(self, plan: MicroBatchPlan, loss_fn: MicroLossFn, forward_only: bool,
            routes: RoutePass | None = None) -> list[dict[str, Any]]:
        """All micro-batches of `plan` through the pipeline; returns metrics (last stage only).
        `routes`: a MoE model records or replays its routes (actor/routing.py)."""
        self.host.onload(("params",) if forward_only else KINDS)
        device = compute_device()
        context = _context_parallel_group()
        batches = [mb.to(device).as_model_batch(thd=self.thd_attention, context_group=context)
                   for mb in plan.micro_batches]

        def adapt(batch, output):
            return loss_fn(batch["packed"], output)

        routing = (self.router_taps.pass_over(batches, routes) if self.router_taps is not None
                   else contextlib.nullcontext())
        context = torch.no_grad() if forward_only else contextlib.nullcontext()
        with context, routing:
            return forward_backward(self.chunks, batches, adapt, forward_only=forward_only,
                                    seq_length=plan.padded_length, micro_batch_size=1)

    def train_step(self, plan: MicroBatchPlan, loss_fn: MicroLossFn, routes: RoutePass | None = None) -> dict[str, Any]:
        """Forward+backward over one mini-batch, gradient all-reduce, clip, optimizer and LR step."""
        if not self.trainable:
            raise RuntimeError("train_step on a frozen model (built without an optimizer config)")
        start = time.perf_counter()
        self.host.onload()
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self.run(plan, loss_fn, forward_only=False, routes=routes)
        if not self._finite_everywhere(outputs, gradients=not self.chunks[0].config.fp16):
            # One NaN reward or overflow would otherwise go into Adam's moments and every weight:
            # nothing of this mini-batch is applied, and the LR schedule does not advance.
            self.skipped_in_a_row += 1
            return {"outputs": outputs, "grad_norm": float("nan"), "updated": False, "skipped": True,
                    "lr": self.optimizer.param_groups[0]["lr"], "step_time_s": time.perf_counter() - start}
        self.skipped_in_a_row = 0
        if self._fixed_lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self._fixed_lr * group.get("lr_mult", 1.0)
        updated, grad_norm, _ = self.optimizer.step()
        if updated and self._fixed_lr is None:
            self.scheduler.step(increment=1)
        return {
            "outputs": outputs,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "updated": bool(updated),
            "skipped": False,
            "lr": self.optimizer.param_groups[0]["lr"],
            "step_time_s": time.perf_counter() - start,
        }

    def _finite_everywhere(self, outputs: list[dict[str, Any]], gradients: bool = True) -> bool:
        """Whether every rank's losses and (with `gradients`) gradients after the DP all-reduce are
        finite: one collective flag, so that all ranks skip a step together or take it together.
        Under a loss scale (fp16) overflowing gradients are the grad scaler's to skip and back off from."""
        bad = torch.zeros((), device=compute_device())
        for chunk in self.chunks if gradients else ():
            for buffer in chunk.buffers:
                # min and max in one pass, without a boolean copy of the buffer (NaN propagates to both)
                bad += (~torch.isfinite(torch.stack(torch.aminmax(buffer.grad_data)))).any()
        for out in outputs:
            for value in out.values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    bad += (~torch.isfinite(value.detach().to(bad.device))).any()
        if dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    def check_finite(self, before: str) -> None:
        """Raise NonFiniteError naming the first non-finite parameter (on any rank), e.g. before a
        weight sync or a checkpoint: serving or saving such weights would spread the damage."""
        named = list(self._named_parameters())
        # One flag on the device (one host sync), not one per parameter; names only when needed.
        local = torch.stack([~torch.isfinite(p.detach()).all() for _, p in named]).any()
        flag = local.float().to(compute_device())
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag:
            bad = [name for name, p in named if not bool(torch.isfinite(p.detach()).all())] if local else []
            where = f"e.g. '{bad[0]}' on rank {dist.get_rank()}" if bad else "on another rank"
            raise NonFiniteError(f"non-finite weights found before {before} ({where}), which did not happen; "
                                 "lower actor.optim.lr or check the rewards, and resume from the last checkpoint")

    def _named_parameters(self):
        for index, module in enumerate(self.modules()):
            for name, param in module.named_parameters():
                yield (f"chunk{index}.{name}" if len(self.chunks) > 1 else name), param

    @contextlib.contextmanager
    def fixed_lr(self, lr: float):
        """Train at `lr` without advancing the LR schedule: a warm-start phase (SFT) before the
        run's own schedule, which then starts where it would have without the phase. Yields a
        setter for the phase's own schedule."""
        self._fixed_lr = lr

        def set_lr(value: float) -> None:
            self._fixed_lr = value

        try:
            yield set_lr
        finally:
            self._fixed_lr = None
            self.scheduler.step(increment=0)  # puts the schedule's LR back on the param groups

    # ------------------------------------------------------------------ weights and checkpoints
    def offload(self, keep_params: bool = False) -> int:
        """This model's state to host memory (actor/offload.py); `keep_params`: all but the
        parameters (a weight sync still reads them). Returns the bytes freed on the device."""
        return self.host.offload(("grads", "optimizer") if keep_params else KINDS)

    def modules(self) -> list[torch.nn.Module]:
        """The bare GPTModel chunks (DDP unwrapped), their state on the device."""
        self.host.onload(("params",))
        return [getattr(chunk, "module", chunk) for chunk in self.chunks]

    def iter_hf_weights(self, dtype: torch.dtype | None = None):
        return iter_hf_tensors(self.modules(), self.arch, dtype=dtype)

    def sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        self.host.onload()
        modules = self.modules()
        model_sd = ({"model": modules[0].sharded_state_dict()} if len(modules) == 1 else
                    {f"model{i}": m.sharded_state_dict() for i, m in enumerate(modules)})
        state = dict(model_sd)
        if self.trainable:
            # is_loading: a fresh optimizer has no Adam state yet; megatron then creates it to load into.
            # The distributed optimizer's format: megatron's default one (fully_sharded_model_space)
            # cannot be saved by its own dist_checkpointing ("flattened_range is not supported");
            # dp_reshardable (megatron-LM's default) resumes at another DP size, not another TP/PP.
            layout = {"metadata": {"distrib_optim_sharding_type": "dp_reshardable"}} if self.distributed_optimizer else {}
            state["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, **layout)
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def save(self, directory: str | Path) -> None:
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        if dist.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self.sharded_state_dict(), str(directory))

    def load(self, directory: str | Path) -> None:
        from megatron.core import dist_checkpointing

        self.host.onload()  # Adam's state is allocated in place, on the device: not on offloaded tensors
        if self.distributed_optimizer:
            _allocate_torch_adam_state(self.optimizer)
        state = dist_checkpointing.load(self.sharded_state_dict(is_loading=True), str(directory))
        modules = self.modules()
        if len(modules) == 1:
            modules[0].load_state_dict(state["model"])
        else:
            for i, module in enumerate(modules):
                module.load_state_dict(state[f"model{i}"])
        if self.trainable:
            # no_grad: the distributed optimizer's main params of float32 weights are views of them.
            with torch.no_grad():
                self.optimizer.load_state_dict(state["optimizer"])
            if self.distributed_optimizer:
                _steps_from_param_groups(self.optimizer)
            self.scheduler.load_state_dict(state["scheduler"])


def _context_parallel_group() -> dist.ProcessGroup | None:
    """The CP group among which each micro-batch's positions are split; None without CP."""
    from megatron.core import parallel_state

    return (parallel_state.get_context_parallel_group()
            if parallel_state.get_context_parallel_world_size() > 1 else None)


def _build_optimizer(chunks, optim_cfg, distributed_optimizer: bool):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    params_dtype = chunks[0].config.params_dtype
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr,
        weight_decay=optim_cfg.weight_decay,
        adam_beta1=optim_cfg.adam_beta1,
        adam_beta2=optim_cfg.adam_beta2,
        adam_eps=optim_cfg.adam_eps,
        clip_grad=optim_cfg.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # fp16's dynamic loss scale starts where torch.amp's GradScaler does: megatron's 2**32 would
        # overflow and skip the first ~17 optimizer steps of a run while it backs off.
        initial_loss_scale=2.0**16,
        params_dtype=params_dtype,
        use_distributed_optimizer=distributed_optimizer,
    )
    return get_megatron_optimizer(config, chunks)


def _torch_adams(optimizer) -> list[torch.optim.Adam]:
    """torch's Adam under megatron's (chained) distributed optimizer: megatron's fallback where
    neither Transformer-Engine nor apex provides a FusedAdam (always on CPU)."""
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    return [inner.optimizer for inner in inners if isinstance(inner.optimizer, torch.optim.Adam)]


def _allocate_torch_adam_state(optimizer) -> None:
    """Megatron's distributed optimizer reads torch Adam's step count to build the state it loads
    into, and asserts on the empty state of one that never stepped: one step at learning rate 0 on
    zero gradients allocates it and moves no weight (the checkpoint then overwrites it all)."""
    for adam in _torch_adams(optimizer):
        if adam.state:
            continue
        rates = [group["lr"] for group in adam.param_groups]
        for group in adam.param_groups:
            group["lr"] = 0.0
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        adam.step()
        adam.zero_grad(set_to_none=True)
        for group, rate in zip(adam.param_groups, rates):
            group["lr"] = rate


def _steps_from_param_groups(optimizer) -> None:
    """torch Adam's per-parameter step count after megatron's distributed optimizer loaded it: the
    checkpoint keeps it in the param groups (`step`), and megatron restores it into one tensor shared
    by every parameter (which Adam's foreach update then increments once per parameter) and then
    overwrites that with the allocated state's count: each parameter gets its own, the saved one."""
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype,
                                             device=state["step"].device)


def _build_scheduler(optimizer, optim_cfg, total_steps: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = int(optim_cfg.warmup_steps)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else optim_cfg.lr,
        max_lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, warmup + 1),
        lr_decay_style=optim_cfg.lr_decay_style,
        start_wd=optim_cfg.weight_decay,
        end_wd=optim_cfg.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
