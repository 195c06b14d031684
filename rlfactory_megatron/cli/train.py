"""`rlf-train [--config FILE] [key=value ...]`: validate the run, resolve the model, then train.

Config errors and model/parallel mismatches are reported before any process group starts.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlf-train", description=__doc__)
    parser.add_argument("--config", help="YAML file merged over the built-in default")
    parser.add_argument("--print-config", action="store_true", help="print the merged config and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6 parallel.tp=2")
    args = parser.parse_args(argv)

    from rlfactory_megatron.config import ConfigError, load_config, to_yaml, validate_against_model
    from rlfactory_megatron.models.hf_arch import UnsupportedCheckpointError, load_arch
    from rlfactory_megatron.models.resolve import resolve_model_path
    from rlfactory_megatron.runtime.launch_env import detect_launch_env

    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(cfg))
            return 0
        hf_dir = resolve_model_path(cfg.model.path)
        arch = load_arch(hf_dir)
        launch = detect_launch_env()
        world = launch.world_size if launch.launcher != "single" else cfg.parallel.tp * cfg.parallel.pp
        validate_against_model(cfg, arch, world)
    except (ConfigError, UnsupportedCheckpointError, ValueError) as exc:
        print(f"rlf-train: error: {exc}", file=sys.stderr)
        return 2
    print(f"rlf-train: config ok; model {arch.model_type} ({arch.num_layers} layers, hidden {arch.hidden_size}) "
          f"from {hf_dir}; parallel tp={cfg.parallel.tp} pp={cfg.parallel.pp} on {world} rank(s).")
    print("rlf-train: the RL training loop arrives with the trainer issue; until then use "
          "`rlf-convert check --hf-dir DIR` to verify the Megatron model against transformers.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
