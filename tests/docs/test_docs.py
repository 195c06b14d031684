"""docs/ cannot drift: the configuration reference is the schema's, and every command the
README and docs/ mark as running on CPU runs (in order, per document, from a checkout-like
folder), or is run by the test its tag names."""
import pytest

from blocks import ROOT, block_env, cpu_blocks, run_block, workdir

# tag -> where it is run; `ci` is the README's first block: the two commands CI and the learning test run.
TAGGED = {"ci": None, "multinode": "tests/trainer/test_multinode.py", "mpirun": "tests/trainer/test_multinode.py"}


def test_configuration_reference_is_the_schemas():
    from rlfactory_megatron.config.reference import render

    assert (ROOT / "docs" / "configuration.md").read_text() == render(), (
        "docs/configuration.md is stale: .venv/bin/python -m rlfactory_megatron.config.reference > docs/configuration.md")


def test_every_tagged_block_is_run_by_its_test():
    tags = [b.tag for b in cpu_blocks() if b.tag]
    assert sorted(tags) == sorted(TAGGED), tags
    for tag, test in TAGGED.items():
        if test:
            assert f'docs_block("{tag}")' in (ROOT / test).read_text(), (tag, test)
    top = next(b for b in cpu_blocks() if b.tag == "ci")
    assert top.file == "README.md" and top.line == 3  # the README starts with it
    commands = [line.split("#")[0].strip() for line in top.body.splitlines()]
    assert commands == ["./install.sh && .venv/bin/rlf-train", "./install.sh && scripts/test.sh"]
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("./install.sh\nexec scripts/test.sh")
    learning = (ROOT / "tests" / "trainer" / "test_embedded_default_learns.py").read_text()
    # The README's command: rlf-train with an output folder and nothing else.
    assert '[str(BIN / "rlf-train"), f"trainer.output_dir={out}", *overrides, warm_starts]' in learning
    assert "def test_embedded_default_learns_to_use_the_tool(tmp_path):" in learning
    assert "    steps = _learns(tmp_path)\n" in learning


@pytest.mark.parametrize("document", sorted({b.file for b in cpu_blocks() if not b.tag}))
def test_documented_cpu_commands_run(tmp_path, document):
    work = workdir(tmp_path)
    env = block_env(tmp_path)
    for block in (b for b in cpu_blocks() if b.file == document and not b.tag):
        done = run_block(block, work, env)
        assert done.returncode == 0, f"{block.file}:{block.line}\n{block.body}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
