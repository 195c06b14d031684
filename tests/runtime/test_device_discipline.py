"""The device discipline (RLF_DEVICE_DISCIPLINE=1) makes a CPU run fail where a GPU run would, naming
the line; what a GPU allows (scalars, host indices, transfers, handles) passes."""
import os
import subprocess
import sys
import textwrap

import pytest

# A fresh interpreter: the discipline, like the CPU adaptation under it, stays for the process.
SCRIPT = textwrap.dedent('''
    import asyncio, io, pickle, sys, threading
    import torch
    from rlfactory_megatron.runtime.cpu_compat import compute_device, enable_cpu_compat
    from rlfactory_megatron.runtime.device_discipline import DeviceDisciplineError, placement

    def old_pack_bucket(named_tensors):  # 7dc69f9's rollout/engines.py, as it was
        flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named_tensors]
        return {"names": [n for n, _ in named_tensors], "data": torch.cat(flat).numpy().tobytes()}

    def refused(what, call):
        try:
            call()
        except DeviceDisciplineError as exc:
            print(f"{what}: {exc}")
        else:
            print(f"{what}: not refused")

    assert enable_cpu_compat() and compute_device().type == "cuda"  # the CPU stands in for the device
    model = torch.nn.Linear(4, 4).to(compute_device())
    batch = torch.randn(3, 4).to(compute_device())
    host = torch.randn(3, 4)
    out = model(batch)
    assert placement(model.weight) == placement(out) == placement(out[0]) == "device"
    assert placement(host) == "host" and placement(batch.cpu()) == "host"
    refused("old pack_bucket", lambda: old_pack_bucket([("w", model.weight), ("b", model.bias)]))
    refused("mixing", lambda: out * host)
    refused("pickling", lambda: pickle.dumps(out))
    refused("host model input", lambda: model(host))
    # What a GPU allows: 0-dim and Python scalars, host indices, explicit transfers, files, handles.
    out * torch.tensor(2.0) + 1
    out[torch.tensor([0, 2])], out[host[:, 0] > 0]
    out.detach().cpu().numpy(), out.detach().to("cpu").numpy(), host.copy_(out.detach())
    torch.save(model.state_dict(), io.BytesIO())
    from rlfactory_megatron.rollout.handoff import StagingBuffers
    StagingBuffers([compute_device()]).stage([("w", model.weight), ("b", model.bias)])
    print("allowed: ok")

    def in_thread(call):  # a thread the run starts (the rollout loop, the engine step thread)
        result = {}
        def body():
            try:
                result["value"] = call()
            except BaseException as exc:
                result["error"] = exc
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    refused("thread mixing", lambda: in_thread(lambda: out * host))
    refused("to_thread mixing", lambda: asyncio.run(asyncio.to_thread(lambda: out * host)))
    refused("device indices", lambda: host[torch.tensor([0, 2]).to(compute_device())])
    refused("device mask", lambda: host[out[:, 0] > 0])
    refused("device values by index", lambda: host.__setitem__(torch.tensor([0, 1]), out[:2].detach()))
    # What a GPU allows: a copy into a slice or an element, a 0-dim value by index, host indices.
    host[0] = out[0].detach()
    host[1:3] = out[1:3].detach()
    host[torch.tensor([0, 2])] = out[0, 0].detach()
    host[torch.tensor([0, 2])], host[host[:, 0] > 0], host[torch.tensor(1).to(compute_device())]
    assert in_thread(lambda: placement(out.detach().cpu())) == "host"
    assert in_thread(lambda: placement(torch.ones(2, device="cuda"))) == "device"
    print("allowed by index and in threads: ok")
''')


def _line_of(text: str) -> int:
    return next(number for number, line in enumerate(SCRIPT.splitlines(), start=1) if text in line)


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> dict[str, str]:
    """The script's verdicts, by case."""
    script = tmp_path_factory.mktemp("discipline") / "gpu_bugs.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, RLF_DEVICE_DISCIPLINE="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return {line.split(":")[0]: line for line in out.stdout.splitlines()}


def test_the_discipline_fails_the_old_pack_bucket_and_device_host_mixes_naming_the_line(lines):
    # The old byte route of every multi-rank weight sync: `.numpy()` of the CUDA bucket on a GPU.
    assert ".numpy() of a tensor that lives on the GPU" in lines["old pack_bucket"]
    assert f"gpu_bugs.py:{_line_of('torch.cat(flat).numpy()')} (" in lines["old pack_bucket"]
    assert "mul mixes a GPU tensor with a host tensor of shape [3, 4]" in lines["mixing"]
    assert f"gpu_bugs.py:{_line_of('lambda: out * host')} (" in lines["mixing"]
    assert "pickled for another process" in lines["pickling"]
    assert "linear mixes a GPU tensor with a host tensor" in lines["host model input"]
    assert lines["allowed"] == "allowed: ok"


def test_the_device_discipline_holes_threads_and_indexing(lines):
    # Issue 53 item 13: in every thread the run starts (threading.Thread, asyncio.to_thread's
    # workers), and by indexing a host tensor with GPU indices, a GPU mask, or putting GPU values
    # in through an index; what a GPU allows by index and in threads passes.
    assert "mul mixes a GPU tensor with a host tensor" in lines["thread mixing"], lines["thread mixing"]
    assert "mul mixes a GPU tensor with a host tensor" in lines["to_thread mixing"], lines["to_thread mixing"]
    assert f"gpu_bugs.py:{_line_of('lambda: in_thread(lambda: out * host)')} (" in lines["thread mixing"]
    for case in ("device indices", "device mask"):
        assert "a host tensor indexed by a GPU tensor of indices or a GPU mask" in lines[case], lines[case]
    assert "GPU values put into a host tensor through an index" in lines["device values by index"]
    assert lines["allowed by index and in threads"] == "allowed by index and in threads: ok"
