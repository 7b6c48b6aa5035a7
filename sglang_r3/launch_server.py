"""``python -m sglang_r3.launch_server``: SGLang's launcher with routing shipped by rollout id.

Takes every ``python -m sglang.launch_server`` argument plus::

    --return-routed-experts          record routing and ship it (turns on upstream's
                                     --enable-return-routed-experts underneath)
    --routing-cache URL              cache service (http://host:8080 or grpc://host:50051)
    --routing-api-key KEY            its API key (or SGLANG_R3_API_KEY)
    --routing-on-cache-error {fail,inline}
    --routing-on-retraction {mark,fail}
    --routing-put-attempts N, --routing-put-timeout S, --routing-lookup always|seen
    --routing-tag-header NAME        header naming a request's rollout id (default:
                                     X-SMG-Routing-Key, what sglang-router forwards)
    --routing-require-tag            refuse untagged generation requests (400)
    --routing-share-prompt {auto,always,never}
                                     store a first turn's prompt rows as their own,
                                     deduplicated segment (default auto: n > 1 only)
    --routing-dp-affinity {rollout,off}
                                     with --dp-size > 1, send a rollout's requests to
                                     the DP rank its id hashes to (default rollout:
                                     later turns hit their prefix KV there)
    --routing-format-version {2,3}   the routing frame version written (default 3; 2
                                     while readers predate format v3)

``--help`` shows SGLang's options and these, in their own group.

``--device cpu`` also prepares the CPU recipe (stub libcuda, CPU engine) and
re-executes itself so the dynamic loader sees it.

``--tokenizer-worker-num N > 1`` points SGLang's HTTP workers at
:mod:`sglang_r3.worker_app` (through ``SGLANG_HTTP_SERVER_APP_PATH``), which loads
the extension in each of them, and gives them one ``PROMETHEUS_MULTIPROC_DIR``
(unless set) so that ``/r3/metrics`` sums them.

Exit status 2 means the configuration was refused before SGLang started, with the
reason on stderr.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from sglang_r3.config import (
    DEFAULT_TAG_HEADER,
    DP_AFFINITY_CHOICES,
    ENV_DP_AFFINITY,
    ENV_FORMAT_VERSION,
    ENV_REQUIRE_TAG,
    ENV_SHARE_PROMPT,
    ENV_TAG_HEADER,
    FORMAT_VERSION_CHOICES,
    SHARE_PROMPT_CHOICES,
    ConfigError,
    EngineConfig,
)

_REEXEC = "SGLANG_R3_REEXEC"


_GROUP = "R3 routing capture (sglang_r3)"
_GROUP_HELP = (
    "Record every token's routed experts and ship them to the routing cache by rollout "
    "id (docs/engine.md). The options after this group are SGLang's own, passed through; "
    "--device cpu also prepares SGLang's CPU engine."
)


def _add_r3_args(p: argparse.ArgumentParser) -> Any:
    """Our flags, in their own group (shown by ``--help`` next to SGLang's); the group."""
    g = p.add_argument_group(_GROUP, _GROUP_HELP)
    _add_capture_args(g)
    _add_policy_args(g)
    _add_request_args(g)
    _add_write_args(g)
    return g


def _add_capture_args(g: Any) -> None:
    """What is recorded and where it is shipped: the switch, the cache and its key."""
    g.add_argument(
        "--return-routed-experts",
        action="store_true",
        help="record routing and ship it to --routing-cache (turns on SGLang's "
        "--enable-return-routed-experts)",
    )
    g.add_argument(
        "--routing-cache",
        metavar="URL",
        default=os.environ.get("SGLANG_R3_ROUTING_CACHE", ""),
        help="the routing cache service: http(s)://host:8080 or grpc://host:50051 "
        "(default: $SGLANG_R3_ROUTING_CACHE)",
    )
    g.add_argument(
        "--routing-api-key",
        metavar="KEY",
        default=os.environ.get("SGLANG_R3_API_KEY"),
        help="its API key (default: $SGLANG_R3_API_KEY; prefer the variable, argv is "
        "visible in ps)",
    )


def _add_policy_args(g: Any) -> None:
    """What a request does when the cache fails, the scheduler retracts it, or its
    rollout has not been seen."""
    g.add_argument(
        "--routing-on-cache-error",
        choices=["fail", "inline"],
        default="fail",
        help="when the cache cannot be written: fail the request with 503, or answer "
        "with the routing inline and stored: false (default: fail)",
    )
    g.add_argument(
        "--routing-on-retraction",
        choices=["mark", "fail"],
        default="mark",
        help="a request the scheduler retracted: store its rows and mark the reference, "
        "or fail it with 503 (default: mark)",
    )
    g.add_argument(
        "--routing-lookup",
        choices=["always", "seen"],
        default="always",
        help="look tagged rollouts up before generation: always (default; conflicts and "
        "an unreachable cache refused before compute), or only rollout ids this server "
        "has seen (no round trip for new rollouts; conflicts found at write time)",
    )


def _add_request_args(g: Any) -> None:
    """How requests name their rollout, share a first prompt, and pick a DP rank."""
    g.add_argument(
        "--routing-tag-header",
        metavar="NAME",
        default=os.environ.get(ENV_TAG_HEADER, DEFAULT_TAG_HEADER),
        help="a request with no custom_params tag is tagged with the rollout id in this "
        "header; sglang-router forwards X-SMG-Routing-Key and routes by it (default: "
        f"{DEFAULT_TAG_HEADER}; empty turns it off)",
    )
    g.add_argument(
        "--routing-require-tag",
        action="store_true",
        default=os.environ.get(ENV_REQUIRE_TAG, "0").lower() in ("1", "true"),
        help="refuse every generation request that names no rollout (400) instead of "
        "generating it with no routing stored (default: off; on in deploy/)",
    )
    g.add_argument(
        "--routing-share-prompt",
        choices=SHARE_PROMPT_CHOICES,
        default=os.environ.get(ENV_SHARE_PROMPT, "auto"),
        help="store a first turn's prompt rows as their own segment, which the cache "
        "keeps once for every rollout with the same prompt and rows, when the request's "
        "tag does not say: auto (default: requests with n > 1), always (also GRPO "
        "samples sent one request each, e.g. behind sglang-router), never",
    )
    g.add_argument(
        "--routing-dp-affinity",
        choices=DP_AFFINITY_CHOICES,
        default=os.environ.get(ENV_DP_AFFINITY, "rollout"),
        help="with --dp-size > 1: send a tagged request that names no DP rank "
        "(routed_dp_rank) to the rank its rollout id hashes to, so a rollout's later "
        "turns hit their prefix KV there (default: rollout), or leave every request to "
        "SGLang's load balancing (off: a later turn may land on another rank and "
        "recompute its prefix)",
    )


def _add_write_args(g: Any) -> None:
    """How each cache write goes: the frame version written, tries and timeouts."""
    g.add_argument(
        "--routing-format-version",
        type=int,
        choices=FORMAT_VERSION_CHOICES,
        default=os.environ.get(ENV_FORMAT_VERSION, "3"),  # argparse applies type=int
        help="the routing frame format version to write: 3 (default), or 2 while a cache "
        "service or trainer of this fleet predates format v3 (it refuses v3 frames); "
        "upgrade the readers first (docs/format.md section 18.5)",
    )
    g.add_argument(
        "--routing-put-attempts",
        metavar="N",
        type=int,
        default=3,
        help="tries per cache write, jittered backoff from 0.1 s (default: 3)",
    )
    g.add_argument(
        "--routing-put-timeout",
        metavar="S",
        type=float,
        default=10.0,
        help="seconds per cache write try (default: 10)",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_r3.launch_server",
        add_help=False,
        description="SGLang with R3 routing capture; all other arguments go to SGLang.",
    )
    _add_r3_args(p)
    return p


def _help() -> str:
    """SGLang's help with ours added as their own group."""
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser(
        prog="python -m sglang_r3.launch_server",
        description="SGLang's server with R3 routing capture (sglang_r3). Takes every "
        "`python -m sglang.launch_server` option, plus the routing options of the "
        f'"{_GROUP}" group.',
    )
    ServerArgs.add_cli_args(p)
    group = _add_r3_args(p)
    groups = getattr(p, "_action_groups", None)
    if isinstance(groups, list) and group in groups:
        # Ours first, before SGLang's ~300 options (argparse lists groups in this order).
        groups.remove(group)
        groups.insert(0, group)
    return p.format_help()


def _flag(rest: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(rest):
        if arg == name and i + 1 < len(rest):
            return rest[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _device(rest: Sequence[str]) -> str | None:
    """``--device`` from the command line, else from SGLang's ``--config`` YAML file.

    The Kubernetes manifests keep SGLang's arguments in a ConfigMap mounted as that
    file, so the CPU recipe must see a ``device: cpu`` written there too.
    """
    device = _flag(rest, "--device")
    config = _flag(rest, "--config")
    if device is None and config is not None:
        import yaml

        try:
            with open(config) as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            return None  # SGLang's own parser reports an unreadable config file
        if isinstance(data, dict) and data.get("device") is not None:
            device = str(data["device"])
    return device


def _fail(message: str) -> int:
    print(f"sglang_r3.launch_server: {message}", file=sys.stderr)
    return 2


def _check_cache(config: EngineConfig) -> str | None:
    """Reach the cache with the key; an error message, or None when usable or merely down."""
    from r3_client import AuthError, Retry, RolloutNotFoundError, RoutingClient, TransportError

    try:
        with RoutingClient(
            config.routing_cache, api_key=config.api_key, retry=Retry(attempts=1)
        ) as c:
            c.stat("r3-launcher-probe")
    except RolloutNotFoundError:
        return None
    except AuthError as exc:
        return f"the routing cache refused the API key: {exc}"
    except TransportError as exc:
        print(
            f"sglang_r3.launch_server: warning: routing cache {config.routing_cache} "
            f"unreachable now ({exc}); requests follow --routing-on-cache-error until it is up",
            file=sys.stderr,
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, prepare the environment, verify the plugin, run SGLang's server."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(_help())
        return 0
    ours, rest = _parser().parse_known_args(argv)
    if ours.routing_cache and not ours.return_routed_experts:
        return _fail("--routing-cache needs --return-routed-experts")
    if ours.return_routed_experts and not ours.routing_cache:
        return _fail("--return-routed-experts needs --routing-cache URL (the cache service)")
    env = dict(os.environ)
    if ours.return_routed_experts:
        try:
            config = EngineConfig(
                routing_cache=ours.routing_cache,
                api_key=ours.routing_api_key,
                on_cache_error=ours.routing_on_cache_error,
                on_retraction=ours.routing_on_retraction,
                put_attempts=ours.routing_put_attempts,
                put_timeout_s=ours.routing_put_timeout,
                lookup=ours.routing_lookup,
                tag_header=ours.routing_tag_header.strip().lower(),
                require_tag=ours.routing_require_tag,
                share_prompt=ours.routing_share_prompt,
                dp_affinity=ours.routing_dp_affinity,
                format_version=ours.routing_format_version,
            )
            EngineConfig.from_env(config.to_env())  # the same checks children will run
        except ConfigError as exc:
            return _fail(str(exc))
        env.update(config.to_env())
        if "--enable-return-routed-experts" not in rest:
            rest.append("--enable-return-routed-experts")
    plugins = env.get("SGLANG_PLUGINS", "")
    if plugins and "r3" not in plugins.split(","):
        return _fail(f"SGLANG_PLUGINS={plugins!r} excludes this extension's plugin 'r3'")
    if _device(rest) == "cpu" and env.get(_REEXEC) != "1":
        from sglang_r3.cpu import CpuSetupError, prepare_env

        try:
            env = prepare_env(env)
        except CpuSetupError as exc:
            return _fail(str(exc))
        env[_REEXEC] = "1"
        # The dynamic loader reads LD_LIBRARY_PATH at process start: start again.
        os.execve(sys.executable, [sys.executable, "-m", "sglang_r3.launch_server", *argv], env)
    os.environ.update(env)
    return _run(rest)


def _run(rest: list[str]) -> int:
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sglang_r3.config import engine_config
    from sglang_r3.errors import StartupError
    from sglang_r3.hooks import check_process
    from sglang_r3.targets import HTTP_TARGETS

    load_plugins()
    server_args = prepare_server_args(rest)
    config = engine_config()
    metrics_dir = None
    if (getattr(server_args, "tokenizer_worker_num", 1) or 1) > 1:
        problem = _use_worker_app(server_args, config.enabled)
        if problem:
            return _fail(problem)
        metrics_dir = _metrics_dir()
    try:
        check_process(HTTP_TARGETS, server_args)
    except StartupError as exc:
        return _fail(str(exc))
    if config.enabled:
        problem = _check_cache(config)
        if problem:
            return _fail(problem)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def _use_worker_app(server_args: Any, enabled: bool) -> str | None:
    """Point SGLang's HTTP workers at :mod:`sglang_r3.worker_app`; a refusal, or None.

    Under ``--tokenizer-worker-num > 1`` SGLang's HTTP workers import the app named
    by ``SGLANG_HTTP_SERVER_APP_PATH`` (read when the server starts, so setting it
    here, after SGLang is imported, is in time) and load no plugins themselves.  A
    value of the user's own would replace ours, so it is refused when routing is
    shipped (and left alone when it is not).
    """
    from sglang_r3.launch.startup import APP_PATH, APP_PATH_ENV, worker_app_problem

    if os.environ.get(APP_PATH_ENV) in (None, ""):
        os.environ[APP_PATH_ENV] = APP_PATH
    return worker_app_problem(server_args) if enabled else None


def _metrics_dir() -> str | None:
    """A fresh ``PROMETHEUS_MULTIPROC_DIR`` unless the user set one (then None), so that
    every HTTP worker's ``/r3/metrics`` answers the counters summed over all workers."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    path = tempfile.mkdtemp(prefix="sglang_r3-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


if __name__ == "__main__":
    sys.exit(main())
