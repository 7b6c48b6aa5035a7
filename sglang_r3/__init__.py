"""SGLang extension for Rollout Routing Replay.

The plugin (``sglang.srt.plugins`` entry point) and the ``--return-routed-experts``
launcher land with issue 5; the routing format they will ship lives in
:mod:`r3_client`.
"""
