"""A MoE model's routes: recorded in one pass and replayed in another (routing replay R2), or the
engines' replayed (R3) or only compared with (rollout.record_routes), and the per-step routing
metrics (agreement with the replayed or compared routes, expert load per layer, aux loss).

Routes are kept per token of the batch ([B, T, layers, top-k], aligned like the log-probs), and a
pass looks up its micro-batch's by the micro-batch's own attention inputs, so replay holds under any
pipeline schedule, virtual stages and activation recompute (no queue consumed in call order).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from rlfactory_megatron.actor.batch import PackedMicroBatch
from rlfactory_megatron.runtime.cpu_compat import compute_device

NO_ROUTE = -1  # a position no batch token sits at (pack padding): the router's own choice stands


@dataclass
class RoutePass:
    """What one pass over a plan does with routes: `record` them, `replay` the given ones ([rows of
    the batch the plan cuts, T, layers, top-k]), or `compare` the router's own choices with the
    given ones and take its own; the router's agreement with the replayed or compared routes is
    counted on the tokens `compared_on` marks ([rows, T] bool; None: every token)."""

    record: bool = False
    replay: Optional[torch.Tensor] = None
    compare: Optional[torch.Tensor] = None
    compared_on: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.replay is not None and self.compare is not None:
            raise ValueError("a pass replays routes or compares with them, not both")

    @property
    def reference(self) -> Optional[torch.Tensor]:
        """The routes the router's own choices are counted against."""
        return self.replay if self.replay is not None else self.compare


class _LayerRouter:
    """Sits in a megatron router's `router_replay` slot (its top-k hook); one per MoE layer and model,
    so no list shared between models (megatron's RouterReplay keeps a global one)."""

    def __init__(self, taps: "RouterTaps", layer: int) -> None:
        self.taps, self.layer = taps, layer

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        chosen = self.taps.route(self.layer, own)
        return scores.gather(1, chosen), chosen


class RouterTaps:
    """Our hook on every router of one model's chunks: records, replays and counts routes for the
    micro-batch the running layer belongs to."""

    def __init__(self, chunks: list[torch.nn.Module], num_layers: int, num_experts: int, top_k: int) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.transformer_layer import TransformerLayer

        if chunks[0].config.moe_router_fusion:  # Transformer-Engine's fused top-k never calls the hook
            raise ValueError("routes are recorded and replayed by megatron's unfused router: build with "
                             "moe_router_fusion=False")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.sequence_parallel = bool(chunks[0].config.sequence_parallel)
        self._pass: Optional[dict[str, Any]] = None
        self._recorded: dict[tuple[int, int], torch.Tensor] = {}  # (micro-batch, layer) -> [tokens, top-k]
        self._recorded_from: list[PackedMicroBatch] = []
        self.reset_metrics()
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TransformerLayer) and isinstance(getattr(module, "mlp", None), MoELayer):
                    module.mlp.router.router_replay = _LayerRouter(self, module.mlp.router.layer_number - 1)
                    # Every call of the layer (its recompute in the backward included) names its micro-batch.
                    module.register_forward_pre_hook(self._enter_layer, with_kwargs=True)

    def reset_metrics(self) -> None:
        # On the device: counting costs no host sync per layer.
        self.load = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=compute_device())
        # per layer: token routes on which the router agreed with the replayed ones, and compared
        self.agreement = torch.zeros(self.num_layers, 2, dtype=torch.float64, device=compute_device())
        # Router calls that added to megatron's aux-loss tracker (recomputes too), per layer.
        self.loss_calls = torch.zeros(self.num_layers, dtype=torch.float64)
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()

    @staticmethod
    def _key(model_batch: dict[str, Any]) -> int:
        # THD attention gets the micro-batch's PackedSeqParams object itself (also in a recompute);
        # the mask path its mask, which a recompute passes detached: the same storage.
        params = model_batch.get("packed_seq_params")
        return id(params) if params is not None else model_batch["attention_mask"].data_ptr()

    def _enter_layer(self, module, args, kwargs) -> None:
        if self._pass is not None:
            self._pass["current"] = self._pass["index"][self._key(kwargs)]

    @contextlib.contextmanager
    def pass_over(self, model_batches: list[dict[str, Any]], routes: Optional[RoutePass]) -> Iterator[None]:
        """Route the micro-batches of one pass: `routes` says whether to record or replay."""
        routes = routes or RoutePass()
        micro_batches = [b["packed"] for b in model_batches]  # a CP rank's: its share of the pack
        local = [self._local_positions(mb) for mb in micro_batches]
        device = compute_device()
        self._pass = {"index": {self._key(b): i for i, b in enumerate(model_batches)}, "current": None,
                      "tokens": [self._token_positions(mb)[pos].to(device) for mb, pos in zip(micro_batches, local)],
                      "record": {} if routes.record else None, "counted": set(),
                      "reference": None if routes.reference is None else
                      [self._packed(mb, routes.reference, NO_ROUTE)[pos].to(device) for mb, pos in zip(micro_batches, local)],
                      "replay": routes.replay is not None,
                      "compared": None if routes.reference is None or routes.compared_on is None else
                      [self._packed(mb, routes.compared_on, False)[pos].to(device) for mb, pos in zip(micro_batches, local)]}
        try:
            yield
        finally:
            self._recorded, self._recorded_from, self._pass = self._pass["record"], micro_batches, None

    def route(self, layer: int, own: torch.Tensor) -> torch.Tensor:
        """The experts the tokens of the running micro-batch take in `layer` ([tokens, top-k])."""
        state = self._pass
        if state is None:  # a forward outside a planned pass
            return own
        mb = state["current"]
        chosen = own
        tokens = state["tokens"][mb]
        first = (mb, layer) not in state["counted"]  # a recompute routes the same tokens again: count once
        state["counted"].add((mb, layer))
        if torch.is_grad_enabled():
            self.loss_calls[layer] += 1
        if state["reference"] is not None:
            target = state["reference"][mb][:, layer].long()
            known = (target != NO_ROUTE).all(-1)
            if state["replay"]:
                chosen = torch.where(known[:, None], target, own)
            if first:
                compared = known & (tokens if state["compared"] is None else state["compared"][mb])
                same = (own.sort(-1).values == target.sort(-1).values).all(-1) & compared
                self.agreement[layer] += torch.stack([same.sum(), compared.sum()]).double()
        if state["record"] is not None:
            state["record"][(mb, layer)] = chosen.detach()
        if first:
            self.load[layer].index_add_(0, chosen.flatten(), tokens[:, None].expand_as(chosen).flatten().double())
        return chosen

    # ------------------------------------------------------------------ positions and layouts
    def _local_positions(self, mb: PackedMicroBatch) -> torch.Tensor:
        """Pack positions this rank's routers see, in their order: its CP share, then its SP slice."""
        positions = mb.context.positions if mb.context is not None else torch.arange(mb.input_ids.shape[1])
        if self.sequence_parallel:
            from megatron.core import parallel_state as ps

            positions = positions.chunk(ps.get_tensor_model_parallel_world_size())[
                ps.get_tensor_model_parallel_rank()]
        return positions.cpu()

    @staticmethod
    def _token_positions(mb: PackedMicroBatch) -> torch.Tensor:
        """[L] bool: pack positions whose output some token's log-prob is read from."""
        length = mb.input_ids.shape[1] if mb.context is None else int(mb.context.layout.numel())
        tokens = torch.zeros(length, dtype=torch.bool)
        tokens[mb.gather_index[mb.token_valid].cpu()] = True
        return tokens

    def _packed(self, mb: PackedMicroBatch, values: torch.Tensor, fill) -> torch.Tensor:
        """[L, ...] values at the pack's positions from per-token ones ([B, T, ...]); `fill` elsewhere."""
        length = self._token_positions(mb).shape[0]
        packed = torch.full((length, *values.shape[2:]), fill, dtype=values.dtype)
        if mb.rows:
            valid = mb.token_valid.cpu()
            packed[mb.gather_index.cpu()[valid]] = values[mb.rows, : valid.shape[1]][valid]
        return packed

    def recorded(self, shape: tuple[int, int]) -> torch.Tensor:
        """[B, T, layers, top-k] routes the last recording pass took, per token of the batch its
        micro-batches cut (NO_ROUTE where this rank ran no such layer or row)."""
        out = torch.full((*shape, self.num_layers, self.top_k), NO_ROUTE, dtype=torch.int32)
        layers = sorted({layer for _, layer in self._recorded})
        for i, mb in enumerate(self._recorded_from if layers else []):
            local = torch.stack([self._recorded[(i, layer)] for layer in layers], 1).float()  # [n, layers, k]
            if self.sequence_parallel:
                from megatron.core import parallel_state as ps

                parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
                dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
                local = torch.cat(parts)
            packed = (mb.context.gather(local) if mb.context is not None else local).cpu().to(torch.int32)
            if mb.rows:
                valid = mb.token_valid.cpu()
                rows = out[mb.rows, : valid.shape[1]]
                rows[..., layers, :] = torch.where(valid[..., None, None], packed[mb.gather_index.cpu()],
                                                   torch.tensor(NO_ROUTE, dtype=torch.int32))
                out[mb.rows, : valid.shape[1]] = rows
        return out

    def take_metrics(self) -> dict[str, float]:
        """The routing metrics since reset_metrics, summed over every rank (each counted its own
        tokens of its own layers), then reset: expert load imbalance per layer (max / mean tokens
        per expert), agreement of the router with the replayed routes, the router losses."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        # megatron's tracker: per layer, each forward's loss added (the same one again in a recompute).
        names = {"load_balancing_loss": "aux_loss", "seq_load_balancing_loss": "aux_loss", "z_loss": "z_loss"}
        tracked = get_moe_layer_wise_logging_tracker()
        losses = torch.zeros(len(names), self.num_layers, dtype=torch.float64)
        for i, name in enumerate(names):
            if name in tracked:
                values = tracked[name]["values"][: self.num_layers].detach().double().cpu()
                losses[i] = values / self.loss_calls.clamp(min=1)
        holders = (self.loss_calls > 0).double()[None]  # ranks whose forward ran the layer
        stats = torch.cat([self.load.flatten().cpu(), self.agreement.flatten().cpu(), losses.flatten(),
                           holders.flatten()])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)
        load, agreement, losses, holders = stats.split([self.load.numel(), self.agreement.numel(), losses.numel(),
                                                        self.num_layers])
        load, agreement = load.view(self.num_layers, -1), agreement.view(self.num_layers, 2)
        losses = losses.view(len(names), -1)
        metrics = {}
        for layer in range(self.num_layers):
            if load[layer].sum() > 0:
                metrics[f"moe/load_imbalance/layer{layer}"] = float(load[layer].max() / load[layer].mean())
        if agreement[:, 1].sum() > 0:
            metrics["moe/routing_agreement"] = float(agreement[:, 0].sum() / agreement[:, 1].sum())
        for i, name in enumerate(names):
            if name in tracked and holders.sum() > 0:  # the mean over layers of each layer's mean over ranks
                metrics[f"moe/{names[name]}"] = float((losses[i] / holders.clamp(min=1)).sum() / (holders > 0).sum())
        self.reset_metrics()
        return metrics
