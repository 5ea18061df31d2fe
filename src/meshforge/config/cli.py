"""`meshforge config show [--config FILE] [overrides]`: print the effective configuration as TOML."""

from __future__ import annotations

import argparse

from meshforge.config.io import load_config, to_toml


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshforge config", description=__doc__)
    parser.add_argument("action", choices=["show"])
    parser.add_argument("--config", default=None, help="a TOML file (configs/*.toml)")
    args, overrides = parser.parse_known_args(argv)
    print(to_toml(load_config(args.config, overrides)), end="")
    return 0
