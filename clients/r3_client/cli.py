"""The ``r3`` command.

    r3 get <rollout_id> -o out.npy [--start N] [--end N] [--layers 1,3,5]
    r3 stat <rollout_id>
    r3 get-many ids.txt -o dir/          # one .npy per rollout, with a progress bar
    r3 delete ids.txt                    # delete the listed rollouts (batched)
    r3 drop --upto V                     # drop the namespace's rollouts up to weight version V
    r3 serve ...                         # the cache service (registered by cache_service)
    r3 demo | report | rl-demo ...       # engine tools (registered by sglang_r3)

``--url`` (env ``R3_URL``, default ``http://127.0.0.1:8080``; ``grpc://host:port``
for gRPC) and ``--api-key`` (env ``R3_API_KEY``) select the service.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import closing
from dataclasses import asdict
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np

from r3_client._exceptions import R3Error
from r3_client._sync_client import RoutingClient

__all__ = ["main"]


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers wants comma-separated ints, got {text!r}"
        ) from None


def _client(args: argparse.Namespace) -> RoutingClient:
    return RoutingClient(args.url, api_key=args.api_key)


def _get(args: argparse.Namespace) -> int:
    with _client(args) as c:
        routing = c.get(
            args.rollout_id, start=args.start, end=args.end, layers=args.layers, view=args.view
        )
    np.save(args.output, routing.indices, allow_pickle=False)
    print(
        f"{args.rollout_id}: rows [{routing.start}, {routing.end}) x layers "
        f"{list(routing.layer_ids)} x top-{routing.topk} -> {args.output}"
    )
    return 0


def _stat(args: argparse.Namespace) -> int:
    with _client(args) as c:
        info = c.stat(args.rollout_id)
    print(json.dumps(asdict(info), indent=2, default=str))
    return 0


def _get_many(args: argparse.Namespace) -> int:
    ids = _ids(args.ids)
    args.output.mkdir(parents=True, exist_ok=True)
    failed = 0
    with _client(args) as c:
        answers = c.get_many(
            ids,
            start=args.start,
            end=args.end,
            layers=args.layers,
            progress=True,
            return_errors=True,
            view=args.view,
        )
        with closing(answers):  # a failed write releases the stream before the client closes
            for rid, res in answers:
                if isinstance(res, R3Error):
                    failed += 1
                    print(f"{rid}: {res.code}: {res}", file=sys.stderr)
                else:
                    np.save(args.output / f"{rid}.npy", res.indices, allow_pickle=False)
    print(f"{len(ids) - failed} of {len(ids)} rollouts written to {args.output}")
    return 1 if failed else 0


def _ids(path: str) -> list[str]:
    return [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]


def _delete(args: argparse.Namespace) -> int:
    ids = _ids(args.ids)
    with _client(args) as c:
        gone = c.delete_many(ids)
    existed = {d.rollout_id for d in gone if d.existed}
    freed = [d.freed_bytes for d in gone if d.existed]
    shown = "unknown" if None in freed else f"{sum(f or 0 for f in freed)}"
    print(f"{len(existed)} of {len(set(ids))} rollouts deleted; Redis freed {shown} bytes")
    return 0


def _drop(args: argparse.Namespace) -> int:
    with _client(args) as c:
        res = c.drop_consumed(args.upto)
    print(json.dumps(asdict(res)))
    return 0


def _add_client_commands(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get("R3_URL", "http://127.0.0.1:8080"),
        help="http://host:port or grpc://host:port (env R3_URL)",
    )
    common.add_argument(
        "--api-key", default=os.environ.get("R3_API_KEY"), help="bearer API key (env R3_API_KEY)"
    )
    rows = argparse.ArgumentParser(add_help=False)
    rows.add_argument("--start", type=int, default=0, help="first token row")
    rows.add_argument("--end", type=int, default=None, help="one past the last token row")
    rows.add_argument(
        "--layers", type=_layers, default=None, help="absolute MoE layer ids, e.g. 1,3,5"
    )
    rows.add_argument(
        "--view",
        choices=("generated", "latest"),
        default="generated",
        help="rows the engine recomputed: each position's first computation (generated) or "
        "what the rollout's last call attended to (latest); docs/store.md, Views",
    )

    p = sub.add_parser("get", parents=[common, rows], help="fetch one rollout into a .npy")
    p.add_argument("rollout_id")
    p.add_argument("-o", "--output", type=Path, required=True, help="output .npy path")
    p.set_defaults(func=_get)

    p = sub.add_parser("stat", parents=[common], help="describe a stored rollout (JSON)")
    p.add_argument("rollout_id")
    p.set_defaults(func=_stat)

    p = sub.add_parser(
        "get-many",
        parents=[common, rows],
        help="fetch the rollouts listed in a file (one id per line)",
    )
    p.add_argument("ids", help="text file, one rollout id per line")
    p.add_argument("-o", "--output", type=Path, required=True, help="output directory")
    p.set_defaults(func=_get_many)

    p = sub.add_parser(
        "delete",
        parents=[common],
        help="delete the rollouts listed in a file (one id per line) and their views",
    )
    p.add_argument("ids", help="text file, one rollout id per line")
    p.set_defaults(func=_delete)

    p = sub.add_parser(
        "drop",
        parents=[common],
        help="drop every rollout of the key's namespace computed entirely under weight "
        "versions <= --upto (docs/service.md, Lifecycle); prints the totals as JSON",
    )
    p.add_argument("--upto", required=True, help="a weight version: a decimal integer")
    p.set_defaults(func=_drop)


def _add_registered_commands(sub: Any) -> None:
    """Add the subcommands other packages register under the ``r3.commands`` entry point.

    The client imports neither the service nor the engine: ``cache_service``
    registers ``serve`` and ``sglang_r3`` its tools (pyproject.toml).  An entry point
    whose package or extra is not installed (a client-only install, the cache-service
    image without SGLang) fails to import and is left out.
    """
    for ep in sorted(entry_points(group="r3.commands"), key=lambda e: e.name):
        try:
            add = ep.load()
        except ImportError:
            continue
        add(sub)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``r3``."""
    parser = argparse.ArgumentParser(prog="r3", description="sglang-r3 routing tools")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_client_commands(sub)
    _add_registered_commands(sub)
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except R3Error as exc:
        print(f"r3 {args.command}: error: {exc.code}: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
