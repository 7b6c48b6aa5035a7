"""``r3 serve``: command-line flags over :class:`ServiceSettings` (env ``R3_CACHE_*`` too)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_serve_parser", "serve_command"]


def add_serve_parser(sub: Any) -> None:
    """Register the ``serve`` subcommand on an argparse subparsers object."""
    p = sub.add_parser(
        "serve",
        help="run the routing cache service (HTTP + gRPC)",
        description=(
            "Run the routing cache service. Without --redis-url it starts an embedded "
            "redis-server (AOF on) with its files under --data-dir. Every flag can also be "
            "set as an R3_CACHE_<NAME> environment variable."
        ),
    )
    p.add_argument("--redis-url", help="redis:// DSN of an existing Redis (default: embedded)")
    p.add_argument(
        "--redis-cluster",
        action="store_true",
        default=None,
        help="--redis-url is a seed node of a Redis Cluster",
    )
    p.add_argument("--data-dir", type=Path, help="embedded Redis files (default ./r3-data)")
    p.add_argument("--host", help="bind both listeners to this address (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, help="HTTP port (default 8080)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default 50051)")
    p.add_argument(
        "--auth",
        choices=["auto", "on", "off"],
        help="API keys: auto = on whenever a listener is not loopback",
    )
    p.add_argument("--api-keys-file", type=Path, help='JSON file {"<api key>": "<namespace>"}')
    p.add_argument("--ttl", type=int, dest="default_ttl_s", help="default TTL seconds (0=none)")
    p.add_argument(
        "--durability",
        choices=["ack", "replicas", "fsync"],
        help="when a write is answered: ack = Redis applied it (its AOF policy decides the "
        "rest); replicas = WAIT for --durability-replicas replicas; fsync = WAITAOF: the "
        "master's AOF fsynced (Redis >= 7.2). docs/service.md, Durability",
    )
    p.add_argument(
        "--durability-replicas",
        type=int,
        help="replicas each write must reach (default 1 with replicas, 0 with fsync)",
    )
    p.add_argument(
        "--durability-timeout-ms",
        type=int,
        help="how long a write waits for them before it fails with 503 (default 1000)",
    )
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR")
    p.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    """Build settings from env + flags and serve until interrupted."""
    from cache_service.serve import serve
    from cache_service.settings import ServiceSettings
    from r3_client import R3Error

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "redis_url": args.redis_url,
            "redis_cluster": args.redis_cluster,
            "data_dir": args.data_dir,
            "http_port": args.http_port,
            "grpc_port": args.grpc_port,
            "auth": args.auth,
            "api_keys_file": args.api_keys_file,
            "default_ttl_s": args.default_ttl_s,
            "durability": args.durability,
            "durability_replicas": args.durability_replicas,
            "durability_timeout_ms": args.durability_timeout_ms,
            "log_level": args.log_level,
        }.items()
        if v is not None
    }
    if args.host is not None:
        overrides["http_host"] = overrides["grpc_host"] = args.host
    try:
        serve(ServiceSettings(**overrides))
    except (ValueError, OSError, R3Error) as exc:  # bad config, ports, Redis: say so plainly
        print(f"r3 serve: error: {exc}", file=sys.stderr)
        return 2
    return 0
