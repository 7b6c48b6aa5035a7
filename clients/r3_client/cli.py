"""The ``r3`` command.  Subcommands: ``serve`` (needs the ``service`` extra)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``r3``."""
    parser = argparse.ArgumentParser(prog="r3", description="sglang-r3 routing tools")
    sub = parser.add_subparsers(dest="command", required=True)
    try:
        from cache_service.cli import add_serve_parser
    except ImportError:  # client-only install
        pass
    else:
        add_serve_parser(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
