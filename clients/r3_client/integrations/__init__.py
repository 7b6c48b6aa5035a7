"""Glue between RL frameworks and the routing cache: tag requests, fill the trainer's field.

One package per framework, each imported only when named, with a module per process it
runs in: ``rollout`` where SGLang is called (tag, fill), ``driver`` on the trainer's
driver (the step check, expansion), ``worker`` / ``rank`` on each training rank (its
slice of the replay targets).  None imports its framework at import time (each
duck-types the framework's objects, or imports them inside the function that needs
them), and the rollout side and the ranks import nothing of each other
(``tests/test_layering.py``):

* :mod:`r3_client.integrations.tags` -- framework-free: add the rollout tag to a
  SGLang ``/generate`` or OpenAI-style payload, or as the ``X-SMG-Routing-Key``
  header, and stop asking SGLang for inline routing.
* :mod:`r3_client.integrations.slime` -- slime @ 624b824: the rollout key, a custom
  generate function that tags each ``Sample`` and fills ``rollout_routed_experts``.
* :mod:`r3_client.integrations.miles` -- miles @ 31f1ca9: the same, keyed per retry attempt.
* :mod:`r3_client.integrations.samples` -- what slime's and miles' glue share, by process.
* :mod:`r3_client.integrations.areal` -- AReaL 1.0.4: tag ``RemoteSGLangEngine``'s
  requests by rollout id, fill ``ModelResponse.routed_experts`` from the cache.
* :mod:`r3_client.integrations.verl` -- verl 0.9.1: a rollout id per agent-loop
  trajectory on every request it makes, ``DataProto.batch["routed_experts"]`` from the cache.

The contracts they meet are pinned in ``docs/integrations.md``.
"""
