"""`rlf-convert`: HF <-> Megatron distributed checkpoints, and an exactness check against HF.

  rlf-convert hf-to-mcore --hf-dir H --out M --tp T --pp P [--ep E --etp X]
  rlf-convert mcore-to-hf --mcore-dir M --out H2 [--tp T --pp P --ep E --etp X]   (M: also a run checkpoint, step_N or its actor/)
  rlf-convert check --hf-dir H --tp T --pp P [--vpp V --ep E --etp X]

--ep splits a MoE model's experts over E ranks, --etp each expert over X ranks (default: T). The
checkpoint is a distributed one: a run loads it at any layout. Outside a launcher (torchrun/srun/mpirun) the
command starts the T*P*E local CPU processes it needs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _hf_to_mcore(hf_dir: str, out: str, tp: int, pp: int, vpp: int | None, ep: int, etp: int | None) -> dict:
    from rlfactory_megatron.models.builder import build_model_chunks
    from rlfactory_megatron.models.conversion import load_hf_weights
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.models.mcore_checkpoint import save_mcore_checkpoint
    from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed

    arch = load_arch(hf_dir)
    init_distributed(ParallelSizes(tp, pp, vpp, ep=ep, etp=etp))
    try:
        chunks = build_model_chunks(arch)
        load_hf_weights(chunks, arch, hf_dir)
        save_mcore_checkpoint(chunks, arch, out, hf_dir, arch.padded_vocab_size(tp))
    finally:
        destroy_distributed()
    return {"out": out}


def _mcore_to_hf(mcore_dir: str, out: str, tp: int, pp: int, vpp: int | None, ep: int, etp: int | None) -> dict:
    import torch.distributed as dist

    from rlfactory_megatron.models.builder import BuildOptions, build_model_chunks
    from rlfactory_megatron.models.conversion import iter_hf_tensors
    from rlfactory_megatron.models.hf_checkpoint import write_hf_folder
    from rlfactory_megatron.models.mcore_checkpoint import HF_FILES_DIR, load_mcore_checkpoint, read_mcore_meta
    from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed

    arch, padded_vocab = read_mcore_meta(mcore_dir)
    init_distributed(ParallelSizes(tp, pp, vpp, ep=ep, etp=etp))
    try:
        chunks = build_model_chunks(arch, BuildOptions(padded_vocab_size=padded_vocab))
        load_mcore_checkpoint(chunks, mcore_dir)
        tensors = iter_hf_tensors(chunks, arch, dtype=getattr(torch, arch.torch_dtype))
        write_hf_folder(tensors, out, Path(mcore_dir) / HF_FILES_DIR, arch.hf_config, writer=dist.get_rank() == 0)
    finally:
        destroy_distributed()
    return {"out": out}


def _check(hf_dir: str, tp: int, pp: int, vpp: int | None, ep: int, etp: int | None) -> list[dict]:
    from rlfactory_megatron.models.parity import job_parity

    return job_parity(hf_dir, tp, pp, vpp, ep, etp)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlf-convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors folder -> Megatron distributed checkpoint")
    a.add_argument("--hf-dir", required=True)
    a.add_argument("--out", required=True)
    b = sub.add_parser("mcore-to-hf",
                       help="Megatron distributed checkpoint (or a run checkpoint) -> HF safetensors folder")
    b.add_argument("--mcore-dir", required=True)
    b.add_argument("--out", required=True)
    c = sub.add_parser("check", help="logits, loss and gradients of the Megatron model vs transformers")
    c.add_argument("--hf-dir", required=True)
    for p in (a, b, c):
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--pp", type=int, default=1)
        p.add_argument("--vpp", type=int, default=None)
        p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE models)")
        p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel ranks (MoE models; default: --tp)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rlfactory_megatron.config import ConfigError, validate_against_model
    from rlfactory_megatron.runtime.distributed import run_as_job
    from rlfactory_megatron.runtime.launch_env import detect_launch_env
    from rlfactory_megatron.models.hf_arch import UnsupportedCheckpointError, load_arch
    from rlfactory_megatron.models.hf_checkpoint import CheckpointError
    from rlfactory_megatron.models.mcore_checkpoint import read_mcore_meta
    from rlfactory_megatron.trainer.checkpoint import actor_model_dir

    try:
        if args.command == "mcore-to-hf":
            args.mcore_dir = str(actor_model_dir(args.mcore_dir))
        arch = read_mcore_meta(args.mcore_dir)[0] if args.command == "mcore-to-hf" else load_arch(args.hf_dir)
        from omegaconf import OmegaConf

        sizes = OmegaConf.create({"parallel": {"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "ep": args.ep,
                                               "etp": args.etp}})
        from rlfactory_megatron.runtime.distributed import ParallelSizes

        world = ParallelSizes(args.tp, args.pp, args.vpp, ep=args.ep, etp=args.etp).smallest_world
        validate_against_model(sizes, arch, world)
        layout = (args.tp, args.pp, args.vpp, args.ep, args.etp)
        if args.command == "hf-to-mcore":
            run_as_job(_hf_to_mcore, world, args.hf_dir, args.out, *layout)
            print(f"rlf-convert: wrote Megatron checkpoint (tp={args.tp}, pp={args.pp}, ep={args.ep}) to {args.out}")
        elif args.command == "mcore-to-hf":
            run_as_job(_mcore_to_hf, world, args.mcore_dir, args.out, *layout)
            print(f"rlf-convert: wrote HF checkpoint to {args.out}")
        else:
            results = [r for every in run_as_job(_check, world, args.hf_dir, *layout) for r in every]
            worst = {k: max(r.get(k, 0.0) for r in results) for k in ("logits_max_diff", "loss_diff", "grad_max_diff")}
            # Under a launcher every rank runs this command; one line per job, not one per rank
            # (ranks writing to one stdout interleave their lines).
            if detect_launch_env().rank == 0:
                print(json.dumps(worst))
            return 0 if worst["logits_max_diff"] <= 1e-4 and worst["grad_max_diff"] <= 1e-4 else 1
    except (ConfigError, UnsupportedCheckpointError, CheckpointError, ValueError) as exc:
        print(f"rlf-convert: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
