"""The device discipline (RLF_DEVICE_DISCIPLINE=1) makes a CPU run fail where a GPU run would, naming
the line; what a GPU allows (scalars, host indices, transfers, handles) passes."""
import os
import subprocess
import sys
import textwrap

# A fresh interpreter: the discipline, like the CPU adaptation under it, stays for the process.
SCRIPT = textwrap.dedent('''
    import io, pickle, sys
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
''')


def _line_of(text: str) -> int:
    return next(number for number, line in enumerate(SCRIPT.splitlines(), start=1) if text in line)


def test_the_discipline_fails_the_old_pack_bucket_and_device_host_mixes_naming_the_line(tmp_path):
    script = tmp_path / "gpu_bugs.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, RLF_DEVICE_DISCIPLINE="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {line.split(":")[0]: line for line in out.stdout.splitlines()}
    # The old byte route of every multi-rank weight sync: `.numpy()` of the CUDA bucket on a GPU.
    assert ".numpy() of a tensor that lives on the GPU" in lines["old pack_bucket"]
    assert f"gpu_bugs.py:{_line_of('torch.cat(flat).numpy()')} (" in lines["old pack_bucket"]
    assert "mul mixes a GPU tensor with a host tensor of shape [3, 4]" in lines["mixing"]
    assert f"gpu_bugs.py:{_line_of('lambda: out * host')} (" in lines["mixing"]
    assert "pickled for another process" in lines["pickling"]
    assert "linear mixes a GPU tensor with a host tensor" in lines["host model input"]
    assert lines["allowed"] == "allowed: ok"
