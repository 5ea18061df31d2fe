"""`meshforge train [--config F] [overrides]`: one rank of a job (under torchrun), or `--nproc N` to start torchrun."""

from __future__ import annotations

import argparse
import os
import sys

from meshforge.config.io import ConfigError, load_config
from meshforge.config.schema import JobConfig


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="meshforge train", description=__doc__)
    parser.add_argument("--config", default=None, help="a TOML file (configs/*.toml)")
    parser.add_argument("--nproc", type=int, default=0, help="start torchrun with this many local processes")
    parser.add_argument("--local-ranks", type=int, default=0, help="run N ranks in this one process (local tensors)")
    parser.add_argument("--dry-run", action="store_true", help="validate and describe the layout without devices")
    parser.add_argument("--world-size", type=int, default=0, help="world size for --dry-run")
    parser.add_argument("--memory", action="store_true", help="--dry-run: exact peak memory of a fake-tensor step")
    parser.add_argument("--json", action="store_true", help="--dry-run --memory: also print one JSON record")
    parser.add_argument(
        "--by-op", action="store_true", help="--dry-run: one block-micro-batch's saved activations by op"
    )
    return parser.parse_known_args(argv)


def launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Re-run this command under torchrun (in this process) with ``nproc`` local processes; a failed job ends with
    one line naming the first failed rank and its exit code, which is returned (no launcher traceback)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    rest = [a for i, a in enumerate(argv) if a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")]
    rest = [a for a in rest if not a.startswith("--nproc=")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a restarted attempt (--max-restarts) must not inherit the dead attempt's store keys (pytorch#135712)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        run(parse_args(["--standalone", f"--nproc_per_node={nproc}", "-m", "meshforge", "train", *rest]))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        failed = len(exc.failures)
        print(
            f"meshforge train: rank {rank} {how} ({failed} of {nproc} ranks failed; their output is above)",
            file=sys.stderr,
            flush=True,
        )
        return code if code > 0 else 1
    except SignalException as exc:  # torchrun stopped its ranks on SIGTERM / SIGHUP: one line, no traceback
        print(f"meshforge train: stopped by signal {int(exc.sigval)}; the ranks were stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def main(argv: list[str]) -> int:
    args, overrides = parse(argv)
    if args.local_ranks:  # the flag is parallelism.local_ranks (validated with the config)
        overrides = [*overrides, "--parallelism.local_ranks", str(args.local_ranks)]
    cfg = load_config(args.config, overrides)  # config errors surface before any process starts
    if args.nproc < 0:
        raise ConfigError(f"--nproc {args.nproc} must be >= 1")
    if (args.memory or args.by_op) and not args.dry_run:
        flag = "--memory" if args.memory else "--by-op"
        raise ConfigError(f"{flag} measures a fake-tensor step and needs --dry-run --world-size N; add --dry-run")
    if args.dry_run:
        from meshforge.tools.dry_run import dry_run

        if args.memory or args.by_op:
            from meshforge.tools.memory_cli import dry_run_memory

            return dry_run_memory(cfg, args.world_size, as_json=args.json, peak=args.memory, by_op=args.by_op)
        return dry_run(cfg, args.world_size)
    if cfg.fault_tolerance.enable and cfg.fault_tolerance.local_replicas and not args.nproc:
        raise ConfigError(
            f"fault_tolerance.local_replicas = {cfg.fault_tolerance.local_replicas} starts local groups and needs "
            "--nproc N (N / local_replicas ranks each); without --nproc set fault_tolerance.group_size instead"
        )
    if args.nproc and cfg.fault_tolerance.enable and cfg.fault_tolerance.local_replicas:
        from meshforge.train.ft_cli import launch_local_replicas

        return launch_local_replicas(cfg, args.nproc, argv)  # a Lighthouse + R groups (train/ft_cli.py)
    if cfg.parallelism.local_ranks:
        return run_local_ranks(cfg, args.nproc)
    if args.nproc:
        from meshforge.train.preflight import preflight

        preflight(cfg, args.nproc)  # every mistake the ranks would find, reported once before any starts
        return launch_torchrun(args.nproc, argv)
    return run(cfg)


def run_local_ranks(cfg: JobConfig, nproc: int) -> int:
    """--local-ranks N: the job's N ranks in this one process (parallel/local_ranks.py); user mistakes are one line
    (the caller prints ConfigError), a diverged run ends with one line and exit 4."""
    from meshforge.parallel.local_ranks import local_world
    from meshforge.train.divergence import EXIT_CODE, TrainingDiverged
    from meshforge.train.loop import train

    if nproc:
        raise ConfigError(f"--local-ranks {cfg.parallelism.local_ranks} runs every rank in this process: drop --nproc")
    from meshforge.model.hf_config import resolve_model_args
    from meshforge.parallel.layout import Layout

    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    Layout.from_config(cfg, cfg.parallelism.local_ranks).check(args)  # the one rule set, before the world starts
    with local_world(cfg):
        try:
            train(cfg)
        except TrainingDiverged as exc:
            print(f"meshforge train: error: {exc}", file=sys.stderr, flush=True)
            return EXIT_CODE
    return 0


def run(cfg: JobConfig) -> int:
    """Train on this rank; user mistakes found after start-up end every rank with one line (printed by the first
    rank that reports it) and exit 2; a diverged run ends with one line and exit 4."""
    from meshforge.parallel.distributed import finish, report_once
    from meshforge.train.divergence import EXIT_CODE, TrainingDiverged
    from meshforge.train.loop import train

    try:
        train(cfg)
    except (ConfigError, TrainingDiverged) as exc:  # raised the same way on every rank (config vs world/model)
        code = EXIT_CODE if isinstance(exc, TrainingDiverged) else 2
        report_once(f"meshforge train: error: {exc}", stop_code=code)  # ranks that wait for this one leave too
        finish(ok=False, code=code)
        return code
    finish(ok=True)
    return 0
