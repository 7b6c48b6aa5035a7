"""SGLang started the way a framework's rollout worker starts it, not by our launcher.

Run as ``python -m tests.support.framework_start STYLE --model-path M --port P`` in an
environment holding SGLang and this package, with the ``SGLANG_R3_*`` variables set (as
a framework's Ray job passes them) and the CPU recipe's environment
(:func:`sglang_r3.cpu.prepare_env`).  Each style makes the calls the framework's own
code makes, at the lines ``tests/integrations/test_framework_engine_startup.py`` pins:

- ``verl``: verl 0.9.1 ``SGLangHttpServer.launch_server``
  (``workers/rollout/sglang_rollout/async_sglang_server.py:424-477``): ``ServerArgs(**args)``
  with ``enable_return_routed_experts`` (verl's ``enable_rollout_routing_replay``,
  ``:403-404``), ``Engine._launch_subprocesses`` with upstream's three process
  functions (``:430-435``), ``set_global_state``, then ``http_server.app`` served by
  its own uvicorn; ``launch_server`` is never called.
- ``slime``: slime's ``SGLangEngine`` (``slime/backends/sglang_utils/sglang_engine.py:48-53``
  at 624b824): ``http_server.launch_server(server_args)`` in a
  ``multiprocessing.Process``, started before any plugin is loaded.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from typing import Any


def _server_args(model_path: str, port: int) -> Any:
    from sglang.srt.server_args import ServerArgs

    from sglang_r3.releases import current

    args: dict[str, Any] = {
        "model_path": model_path,
        "host": "127.0.0.1",
        "port": port,
        "device": "cpu",
        "attention_backend": "torch_native",
        "dtype": "bfloat16",
        "mem_fraction_static": 0.9,
        "max_total_tokens": 4096,
        "sleep_on_idle": True,
        "log_level": "warning",
        "enable_return_routed_experts": True,
    }
    if current().has("cuda_graph_backend_args"):
        args |= {"cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled"}
    else:
        args["disable_cuda_graph"] = True
    return ServerArgs(**args)


def verl(model_path: str, port: int) -> None:
    """verl 0.9.1's start-up: the subprocesses, then the app on its own uvicorn."""
    import sglang.srt.entrypoints.engine as engine
    import uvicorn
    from sglang.srt.entrypoints.http_server import Engine, _GlobalState, app, set_global_state
    from sglang.srt.managers.tokenizer_manager import ServerStatus

    server_args = _server_args(model_path, port)
    tokenizer_manager, template_manager, scheduler_info, *_ = Engine._launch_subprocesses(
        server_args=server_args,
        init_tokenizer_manager_func=engine.init_tokenizer_manager,
        run_scheduler_process_func=engine.run_scheduler_process,
        run_detokenizer_process_func=engine.run_detokenizer_process,
    )
    set_global_state(
        _GlobalState(
            tokenizer_manager=tokenizer_manager,
            template_manager=template_manager,
            scheduler_info=scheduler_info,
        )
    )
    app.is_single_tokenizer_mode = True
    app.server_args = server_args
    app.warmup_thread_kwargs = {"server_args": server_args}
    app.warmup_thread_args = (server_args, None, None)
    tokenizer_manager.server_status = ServerStatus.Up  # verl sets it once uvicorn runs
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def slime(model_path: str, port: int) -> None:
    """slime's start-up: ``launch_server`` in a child process."""
    from sglang.srt.entrypoints import http_server

    proc = multiprocessing.Process(
        target=http_server.launch_server, args=(_server_args(model_path, port),)
    )
    proc.start()
    proc.join()
    sys.exit(proc.exitcode or 0)


def main(argv: list[str] | None = None) -> None:
    """Start one style's server (blocks until it is stopped)."""
    p = argparse.ArgumentParser(prog="python -m tests.support.framework_start")
    p.add_argument("style", choices=["verl", "slime"])
    p.add_argument("--model-path", required=True)
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)
    {"verl": verl, "slime": slime}[a.style](a.model_path, a.port)


if __name__ == "__main__":
    main()
