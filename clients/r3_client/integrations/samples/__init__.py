"""What slime and miles share: both carry routing in a ``Sample``, one module per process.

Both hold ``Sample.rollout_routed_experts`` as ``[len(tokens) - 1, num_layers, K]``,
send a per-sample key as ``X-SMG-Routing-Key``, call a legacy custom generate function
``(args, sample, sampling_params, evaluation=False)`` once per sample, ship
``sample_indices`` to every training rank and fill their routers in one function the
rank-local path replaces.  They differ in the key's field and scheme, the layout's
dtype, their padding and where their functions live; :mod:`r3_client.integrations.slime`
and :mod:`r3_client.integrations.miles` say those and bind what is here:

* :mod:`~r3_client.integrations.samples.framework` -- every side: a framework's name,
  key field and rank-local key; a sample's key and state.
* :mod:`~r3_client.integrations.samples.rollout` -- the rollout process: the custom
  generate function, the fetch into ``Sample``, the rank-local path's stored check.
* :mod:`~r3_client.integrations.samples.driver` -- before dispatch: the step's check and
  its expansion into one ``Sample`` per routing state.
* :mod:`~r3_client.integrations.samples.rank` -- each training rank: its replay targets
  planned from token counts and finished as the framework's fill makes them, the fill's
  loop, the hook's environment.

The rollout and rank modules import nothing of each other.  Samples are duck-typed;
nothing here imports either framework.
"""
