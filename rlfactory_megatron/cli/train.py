"""`rlf-train [--config FILE] [key=value ...]`: validate the run, resolve the model, then train.

Config errors, model/parallel mismatches, data the run cannot use (prompts over
rollout.max_prompt_tokens, a warm-start without demonstrations, a data_source without a scorer)
and a resume of another run's checkpoint are reported before any process group, model, engine
or Ray starts; `--check` does all of that and exits.
Under torchrun/srun/mpirun every process is one rank; started by hand it runs tp*pp*cp local ranks.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


class GpuUnusableError(Exception):
    """The node has a GPU that torch cannot use (runtime/cuda_driver.py)."""


def _train_rank(config_yaml: str, hf_dir: str, verbose: bool) -> dict:
    """One rank's run: its last metrics and the signal that stopped it early, if one did."""
    from rlfactory_megatron.config import config_from_yaml
    from rlfactory_megatron.runtime.console import console_copied_to, library_output_to
    from rlfactory_megatron.runtime.launch_env import detect_launch_env

    cfg = config_from_yaml(config_yaml)
    launch = detect_launch_env()
    rank = launch.rank
    logs = Path(cfg.trainer.output_dir) / "logs"
    log = logs / f"rank{rank:05d}.log"
    try:
        with library_output_to(log, enabled=not verbose), console_copied_to(logs / "console.log", enabled=rank == 0):
            return _train(cfg, hf_dir)
    except Exception as exc:
        if launch.world_size <= 1:
            raise  # main() reports it
        # The other ranks then fail on a collective ("Connection closed by peer"); this line says
        # which rank failed first and why, and where its libraries' output (the root cause of an
        # engine that failed to start, say) was written.
        print(f"rlf-train: rank {rank} failed: {type(exc).__name__}: {str(exc).strip()[:500]}"
              + ("" if verbose else f" (its log: {log})"), file=sys.stderr, flush=True)
        raise


def _train(cfg, hf_dir: str) -> dict:
    from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed
    from rlfactory_megatron.runtime.stop import ignore_usr1_in_helpers
    from rlfactory_megatron.trainer.trainer import Trainer

    ignore_usr1_in_helpers()  # before Ray, vLLM and tools start (runtime/stop.py)
    init_distributed(ParallelSizes.of(cfg.parallel), seed=cfg.trainer.seed)
    trainer = None
    failed = True
    try:
        trainer = Trainer(cfg, hf_dir)
        metrics = trainer.fit()
        failed = False
        return {"metrics": metrics, "stopped_by": trainer.stopped_by, "validation": trainer.last_validation,
                "checkpoint": trainer.last_checkpoint}
    finally:
        try:
            if trainer is not None:
                trainer.close()
            destroy_distributed()
        except Exception as exc:
            if not failed:
                raise
            # The run's own error is what the user must read last, not a teardown's consequence of it.
            print(f"rlf-train: (tearing down after the error: {type(exc).__name__}: {exc})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlf-train", description=__doc__)
    parser.add_argument("--config", help="YAML file over the schema's defaults (without it: the embedded default run)")
    parser.add_argument("--print-config", action="store_true", help="print the merged config and exit")
    parser.add_argument("--plan", action="store_true",
                        help="print the memory each device needs, term by term, and exit (2 if it does not fit)")
    parser.add_argument("--check", action="store_true",
                        help="check everything the run will read (config, model folder, data, tools, rewards, layout, "
                             "memory plan, the checkpoint it resumes) without starting anything, and exit (2: refused)")
    parser.add_argument("--world-size", type=int, help="with --plan or --check: the ranks to plan for (default: this job's)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the libraries' console output (else it goes to <output_dir>/logs/; also RLF_VERBOSE=1)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6 parallel.tp=2")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the flags

    from rlfactory_megatron.config import ConfigError, check_inputs, load_config, to_yaml, validate_against_model
    from rlfactory_megatron.models.hf_arch import UnsupportedCheckpointError, load_arch
    from rlfactory_megatron.runtime.console import console_copied_to, verbose_requested
    from rlfactory_megatron.runtime.launch_env import detect_launch_env
    from rlfactory_megatron.runtime.threads import choose_threads
    from rlfactory_megatron.trainer.checkpoint import CONFIG_FILE, check_resume
    from rlfactory_megatron.trainer.memory_plan import device_memory, memory_plan, resolve_recompute

    try:
        launch = detect_launch_env()
        starts_ranks = not (args.print_config or args.plan or args.check)
        # Before the config is loaded: checking it imports torch. Started by hand, this process
        # is the one rank (revised below for the ranks it spawns: ParallelSizes.smallest_world).
        # A plan, a check or a printed config starts no rank: no threads to choose, nothing to say of them.
        chosen = choose_threads(launch.local_world_size if launch.launcher != "single" else 1) if starts_ranks else None
        if not (args.print_config or args.plan):  # (a login node runs those two; --check, the job's node)
            from rlfactory_megatron.runtime.cuda_driver import unusable_gpu

            problem = unusable_gpu()
            if problem:
                raise GpuUnusableError(problem)
        # A plan is for the GPUs the job will run on: on a machine without one (a login node),
        # `auto` is resolved as a GPU node with the GPU stack resolves it.
        from rlfactory_megatron.runtime.cpu_compat import cuda_available

        implied: list[str] = []  # the preset's settings, written into config.yaml for every rank and a resume
        cfg = load_config(args.config, args.overrides, for_gpu=args.plan and not cuda_available(), preset_log=implied)
        check_inputs(cfg, plan_only=args.plan)
        if implied and launch.rank == 0 and not args.print_config:
            print(f"rlf-train: {cfg.trainer.algorithm} implies {', '.join(implied)}")
        from rlfactory_megatron.runtime.distributed import ParallelSizes, run_as_job

        hand_started = ParallelSizes.of(cfg.parallel).smallest_world  # the ranks started by hand
        if chosen and launch.launcher == "single" and hand_started > 1:
            chosen = choose_threads(hand_started, chosen_before=True)  # fresh processes read it
        if chosen and launch.local_rank == 0:
            print(f"rlf-train: {chosen}")
        from rlfactory_megatron.trainer.model_path import resolve_model_path

        hf_dir = resolve_model_path(cfg.model.path, tokenizer=not args.plan)
        arch = load_arch(hf_dir)
        world = launch.world_size if launch.launcher != "single" else hand_started
        if args.world_size is not None:
            if not (args.plan or args.check) or args.world_size < 1:
                raise ConfigError(f"--world-size {args.world_size}: give --plan or --check a job size >= 1 to plan for")
            world = args.world_size
        validate_against_model(cfg, arch, world)
        detected = device_memory()
        # Before config.yaml is written (or printed, or compared with a checkpoint's): every rank
        # builds the model with the resolved choice.
        recompute = resolve_recompute(cfg, arch, world, detected)
        if args.print_config:
            print(to_yaml(cfg))
            return 0
        judge = cfg.reward.model
        judge_arch = (load_arch(resolve_model_path(judge.path, "reward.model.path", tokenizer=not args.plan))
                      if judge.kind is not None and judge.placement == "colocated" and judge.path else None)
        plan = memory_plan(cfg, arch, world, detected, judge_arch)
        if args.plan:
            if launch.rank == 0:
                print((f"{recompute}\n" if recompute else "") + plan.render())
            plan.check()
            return 0
        plan.check()
        from rlfactory_megatron.trainer.data_checks import check_run_data

        prompts = check_run_data(cfg, str(hf_dir))  # the data, before any model, engine or Ray
        output = Path(cfg.trainer.output_dir)
        resumed = check_resume(cfg, output)
        if args.check:
            if launch.rank == 0:
                print(f"rlf-train: check passed: {cfg.trainer.algorithm} on {arch.model_type} from {hf_dir}, "
                      f"{world} rank(s); {prompts}; "
                      + (f"resumes {resumed}" if resumed else f"starts fresh in {output}"))
            return 0
        output.mkdir(parents=True, exist_ok=True)
        # The run's full config: every rank trains on this text (under a launcher each rank made
        # the same; reading rank 0's file would race its writing), rank 0 keeps it for the record.
        config_yaml = to_yaml(cfg)
        verbose = args.verbose or verbose_requested()
        with console_copied_to(output / "logs" / "console.log", enabled=launch.rank == 0):
            if launch.rank == 0:
                _keep_earlier_config(output / CONFIG_FILE, config_yaml)
                print(f"rlf-train: {cfg.trainer.algorithm} on {arch.model_type} ({arch.num_layers} layers) from {hf_dir}; "
                      f"tp={cfg.parallel.tp} pp={cfg.parallel.pp}{f' cp={cfg.parallel.cp}' if cfg.parallel.cp > 1 else ''}"
                      f"{f' ep={cfg.parallel.ep}' if cfg.parallel.ep > 1 else ''} "
                      f"on {world} rank(s); outputs in {output.resolve()}")
                print(plan.summary())
                if recompute:
                    print(f"rlf-train: {recompute}")
                print(f"rlf-train: {prompts}")
                if not verbose:
                    print(f"rlf-train: library output goes to {output / 'logs'} (--verbose shows it here)")
            results = run_as_job(_train_rank, hand_started, config_yaml, str(hf_dir), verbose)
            stopped_by = results[0]["stopped_by"]
            if stopped_by is not None:  # a stop signal: the run did not finish (runtime/stop.py)
                return 128 + stopped_by
            if launch.rank == 0:
                print(_closing_line(results[0], output, cfg.trainer.save_hf))
    except (ConfigError, UnsupportedCheckpointError, GpuUnusableError, ValueError) as exc:
        print(f"rlf-train: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _keep_earlier_config(path: Path, config_yaml: str) -> None:
    """config.yaml is this attempt's; an earlier attempt's other one stays as config.<n>.yaml."""
    if path.is_file() and path.read_text() != config_yaml:
        n = 1
        while path.with_name(f"config.{n}.yaml").exists():
            n += 1
        path.rename(path.with_name(f"config.{n}.yaml"))
    path.write_text(config_yaml)


def _closing_line(result: dict, output: Path, save_hf: bool) -> str:
    """Where everything went, the last held-out score and mean reward, and the trained model."""
    from rlfactory_megatron.trainer.checkpoint import HF_DIR

    final = result["metrics"] or {}
    line = (f"rlf-train: done. metrics: {output / 'metrics.jsonl'}, TensorBoard: {output / 'tensorboard'}, "
            f"console: {output / 'logs' / 'console.log'}")
    reward = final.get("reward/score/mean")  # none without an RL step (trainer.total_steps=0)
    if reward is not None:
        line += f"; last mean reward {reward:.3f}"
    if result["validation"] is not None:
        step, score = result["validation"]
        line += f"; held-out score {score:.3f} (step {step})"
    checkpoint = result["checkpoint"]
    if checkpoint is not None:
        line += f"; model: {checkpoint / HF_DIR}" if save_hf else f"; checkpoint: {checkpoint}"
    return line


if __name__ == "__main__":
    sys.exit(main())
