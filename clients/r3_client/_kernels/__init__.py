"""The hot loops' kernels, below both the logical types and the codec.

* :mod:`~r3_client._kernels.sortnet` — the sorting network (a top-k row sorted in place);
* :mod:`~r3_client._kernels.native` — which implementation runs each hot loop: the compiled
  ``_r3codec`` (``_r3codec.c``, built by ``pip install`` / ``make bootstrap``) or numpy.

:mod:`r3_client._routing` (the logical types: a row's canonical form, sorted sets) and
:mod:`r3_client.codec` (the bytes) both import them; they import neither (issue 44: before,
the kernels sat inside the codec package, which imports ``_routing``, so ``_routing`` could
reach them only by an import at call time).
"""
