"""Buckets handed to another process by handle (rollout/handoff.py): the receiver maps the sender's
staging buffer (no bytes through the pipe), two buffers serve a whole sync, each shared once, and
host buffers stay for the next sync."""
import multiprocessing
import pickle

import torch

from rlfactory_megatron.rollout.handoff import StagingBuffers, open_staged


def _receiver(pipe) -> None:
    """Opens every staged bucket it is sent and answers with the tensors' bytes it read."""
    opened = {}
    while (message := pipe.recv()) is not None:
        staged, worker = message
        pipe.send([(name, tensor.clone()) for name, tensor in open_staged(staged, worker, opened)])


def test_a_bucket_staged_here_is_read_in_another_process_from_two_reused_buffers():
    torch.manual_seed(0)
    buckets = [[(f"b{i}.w", torch.randn(256, 64)), (f"b{i}.h", torch.randn(7).to(torch.bfloat16))] for i in range(5)]
    staging = StagingBuffers([torch.device("cpu")] * 2)  # two workers reading one device's copy
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    receiver = context.Process(target=_receiver, args=(theirs,))
    receiver.start()
    try:
        sent = []
        for bucket in buckets:
            staged = staging.stage(bucket)
            sent.append(len(pickle.dumps(staged)))
            for worker in range(2):
                mine.send((staged, worker))
                received = mine.recv()  # loaded: the buffer may be packed again two buckets on
                assert [n for n, _ in received] == [n for n, _ in bucket]
                assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(received, bucket))
        mine.send(None)
    finally:
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()
    assert len(staging._slots) == 2  # one device, two buffers for all five buckets
    # Each buffer's handle goes out once per worker; later buckets name it by key.
    handles = [[w["handle"] is not None for w in staging.stage(b)["workers"]] for b in buckets[:2]]
    assert handles == [[False, False], [False, False]]
    bucket_bytes = sum(t.numel() * t.element_size() for _, t in buckets[0])
    assert max(sent) < bucket_bytes / 5  # a layout and handles, not the tensors
    # On the host the buffers (already mapped by the workers) stay for the next sync; a GPU's go
    # back to training when the sync ends.
    kept = staging.end_of_sync()
    staging.release()
    assert kept == staging.alive() and len(kept) == 2


def test_a_vllm_layer_still_waiting_for_weights_keeps_copies_not_views_of_a_staging_buffer():
    # vLLM's layerwise reload holds a layer's weights by reference until all of them arrived; a
    # staged bucket's are views of a buffer that the next bucket but one overwrites.
    import inspect

    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

    from rlfactory_megatron.rollout.engines import _copy_weights_layers_still_wait_for

    staged = torch.arange(8, dtype=torch.float32).share_memory_()
    layer = torch.nn.Linear(2, 2)
    info = LAYERWISE_INFO[layer] = LayerReloadingInfo(restore_metadata=({}, {}), restore_device=torch.device("cpu"))
    try:
        info.loaded_weights.append(("weight", inspect.signature(lambda param, loaded_weight: None).bind(None, staged[2:6])))
        _copy_weights_layers_still_wait_for()
        kept = info.loaded_weights[0][1].arguments["loaded_weight"]
        staged.fill_(-1)  # the buffer packed again
        assert kept.tolist() == [2.0, 3.0, 4.0, 5.0]
    finally:
        del LAYERWISE_INFO[layer]
