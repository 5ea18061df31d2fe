"""`meshforge <command> ...`: parse the command name, dispatch, turn user mistakes into one line and exit 2."""

from __future__ import annotations

import importlib
import sys

from meshforge.config.io import ConfigError

# command -> (module with `main(argv) -> int`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("meshforge.train.cli", "train a model (torchrun or --nproc N); --dry-run --world-size N checks a layout"),
    "config": ("meshforge.config.cli", "config show [--config F] [overrides]: print the effective config"),
    "bench": ("meshforge.bench.cli", "run a matrix of parallel strategies and report throughput, memory, loss"),
    "plan": ("meshforge.plan.cli", "predict memory and throughput of a layout at any scale; --search recommends one"),
    "compare-losses": ("meshforge.tools.compare_losses", "compare two runs' losses step by step"),
    "data": ("meshforge.data.cli", "data prepare INPUT... --out DIR: token shards + manifest; data info DIR"),
    "generate": ("meshforge.tools.generate", "sample text from a checkpoint (--checkpoint DIR --prompt TEXT)"),
    "convert": ("meshforge.checkpoint.hf", "from-hf / to-hf: Hugging Face safetensors <-> meshforge checkpoints"),
    "ft": ("meshforge.train.ft_cli", "ft lighthouse [--port P]: the torchft Lighthouse for fault-tolerant replicas"),
}


def usage() -> str:
    lines = ["usage: meshforge <command> [options]", "", "commands:"]
    lines += [f"  {name:<15} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"meshforge: unknown command {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        if name == "train" and "--parallelism.auto" in rest:  # the planner picks; train/ never imports plan/
            from meshforge.plan.guide.auto import resolve_train_argv

            rest = resolve_train_argv(rest)
        return int(module.main(rest))
    except ConfigError as exc:
        print(f"meshforge {name}: config error: {exc}", file=sys.stderr)
        return 2
