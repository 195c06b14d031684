"""Suite-wide fixtures: tiny random-weight HF checkpoints built once per session (no downloads)."""
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# One checkpoint per supported family, each with the feature that family adds:
# llama: Llama-3 rope scaling; qwen2: qkv bias + a vocab that megatron must pad; qwen3: q/k norm + tied embeddings;
# qwen3_moe: 8 experts, top-2 routing.
TINY_VARIANTS = {
    "llama": dict(),
    "qwen2": dict(vocab_size=500),
    "qwen3": dict(tie_word_embeddings=True),
    "qwen3_moe": dict(),
}


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory):
    from rlfactory_megatron.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_hf")
    return {name: str(make_tiny_hf_model(name, root / name, **kw)) for name, kw in TINY_VARIANTS.items()}


@pytest.fixture(scope="session")
def ray_session(request):
    """One local Ray for the whole suite (a second ray.init in the same process would fail).

    Ray workers import by name what the tests import by name (the envs tests' helper tools, a
    test module's classes pickled by reference), hence pytest.ini's pythonpath on their path.
    """
    import ray

    if not ray.is_initialized():
        root = Path(__file__).resolve().parent.parent
        path = os.pathsep.join(str(root / folder) for folder in request.config.getini("pythonpath"))
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()


# ----------------------------------------------------------------- test order
# The whole suite runs on two xdist workers that take one test at a time. Collected in file
# order, the slowest tests (tests/trainer, last alphabetically) are dispatched last, and the run
# ends with one worker idle while the other finishes a 5-minute test. Longest first, the run ends
# on short tests instead. The durations are the last recorded run's (`--record-durations`);
# a test not in the file runs after the recorded ones, in file order.
DURATIONS = Path(__file__).resolve().parent / "durations.json"


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write each test's seconds (setup + call + teardown) into PATH, a JSON object "
                          "merged with what PATH holds; tests/durations.json orders the suite")


def pytest_collection_modifyitems(config, items):
    import json

    if not DURATIONS.exists():
        return
    seconds = json.loads(DURATIONS.read_text())
    # sort() is stable: unrecorded tests (0 s) keep their file order after the recorded ones.
    items.sort(key=lambda item: -seconds.get(item.nodeid, 0.0))


_recorded: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # Under xdist the controller receives every worker's reports: it alone writes the file. A test
    # in an xdist_group reports "<nodeid>@<group>"; collection knows it by its nodeid.
    nodeid = report.nodeid.split("@", 1)[0]
    _recorded[nodeid] = _recorded.get(nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    import json

    path = session.config.getoption("--record-durations")
    if path is None or hasattr(session.config, "workerinput") or not _recorded:
        return
    path = Path(path)
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update({nodeid: round(s, 2) for nodeid, s in _recorded.items()})
    merged = {nodeid: s for nodeid, s in merged.items() if _still_defined(nodeid)}  # renamed or removed tests go
    path.write_text(json.dumps(dict(sorted(merged.items(), key=lambda kv: -kv[1])), indent=0) + "\n")


def _still_defined(nodeid: str) -> bool:
    """Whether the test a recorded node id names is still defined in its file."""
    file, _, rest = nodeid.partition("::")
    path = Path(__file__).resolve().parent.parent / file
    return path.is_file() and f"def {rest.split('[')[0].split('::')[-1]}(" in path.read_text()
