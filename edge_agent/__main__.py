"""``python -m edge_agent --config FILE [--validate-config]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edge_agent.cli import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edge_agent", description="edgefleet edge agent")
    parser.add_argument("--config", required=True, type=Path, help="agent YAML configuration")
    parser.add_argument("--validate-config", action="store_true", help="check the configuration and exit")
    args = parser.parse_args(argv)
    return run(args.config, validate_config=args.validate_config)


if __name__ == "__main__":
    sys.exit(main())
