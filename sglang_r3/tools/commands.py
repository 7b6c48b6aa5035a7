"""The ``r3`` subcommands this package adds (entry point ``r3.commands``, pyproject.toml).

The demo, the mismatch report and the RL demo run SGLang and an HF model, so they are
offered only where SGLang, torch and transformers are installed; elsewhere ``r3``
keeps its client and service commands.
"""

from __future__ import annotations

import importlib.util
from typing import Any


def add_commands(sub: Any) -> None:
    """Add ``demo``, ``report`` and ``rl-demo`` to the ``r3`` parser's subparsers."""
    if not all(importlib.util.find_spec(m) for m in ("sglang", "torch", "transformers")):
        return
    from sglang_r3.tools.demo import add_demo_parser
    from sglang_r3.tools.mismatch_report import add_report_parser
    from sglang_r3.tools.rl_demo import add_rl_demo_parser

    add_report_parser(sub)
    add_demo_parser(sub)
    add_rl_demo_parser(sub)
