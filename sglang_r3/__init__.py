"""SGLang extension for Rollout Routing Replay.

The plugin (``sglang.srt.plugins`` entry point ``r3``, :mod:`sglang_r3.plugin`) ships
each tagged output's routing to the cache service; ``python -m sglang_r3.launch_server``
starts SGLang with it.  The routing format lives in :mod:`r3_client`.  The modules
directly here are the plugin (SGLang imports them in every process it starts); the
commands built on it (``r3 demo``, ``r3 rl-demo``, ``r3 mismatch-report``, the local
stack) are in :mod:`sglang_r3.tools`.
"""
