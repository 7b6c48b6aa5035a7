"""Tensor-parallel groups on CPU without PyNccl (``--tp-size > 1``, DP attention).

SGLang 0.5.23's ``init_model_parallel_group`` (``distributed/parallel_state.py:2180-2185``)
asks the platform whether it supports PyNccl only for *out-of-tree* platforms.  The
in-tree ``CpuSRTPlatform`` says ``supports_pynccl=False`` (``platforms/interface.py:73``)
but is never asked, so ``use_pynccl`` becomes ``True`` and scheduler start-up dies in
``PyNcclCommunicator`` (``distributed/device_communicators/pynccl.py:116``):
``ValueError: Expected a cuda device, but got: cpu``.  An upstream bug.

This shim makes every group its caller did not decide for built with
``use_pynccl=False`` (what the check would have answered), so collectives go over the
gloo process group.  Every caller of the function is in ``parallel_state`` itself,
which looks it up as a module global, so replacing the global reaches all of them.
"""

from __future__ import annotations

import functools
from typing import Any


def apply() -> None:
    """Replace ``parallel_state.init_model_parallel_group`` with a ``use_pynccl=False`` default."""
    from sglang.srt.distributed import parallel_state

    original = parallel_state.init_model_parallel_group

    @functools.wraps(original)
    def init_model_parallel_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_pynccl") is None:
            kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    parallel_state.init_model_parallel_group = init_model_parallel_group
