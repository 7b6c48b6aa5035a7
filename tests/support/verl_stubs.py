"""What the tests that drive verl's own code on one process stand in for (tests only):
``ray``, which ``verl.protocol`` imports at module level where it is not installed, and
process groups of other sizes and ranks, and the batch verl's agent loop hands the trainer."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any


def stub_ray() -> None:
    """Put a stand-in ``ray`` module in ``sys.modules`` unless ray is importable.

    verl (installed ``--no-deps``) imports ``ray`` for ``DataProtoFuture`` only; nothing the
    tests drive calls it, and the stand-in raises if anything does.
    """
    if "ray" in sys.modules or importlib.util.find_spec("ray") is not None:
        return
    ray = types.ModuleType("ray")

    def _absent(*args: object, **kwargs: object) -> None:
        raise RuntimeError("ray is a stub in tests/support/verl_stubs.py")

    ray.ObjectRef = type("ObjectRef", (), {})  # type: ignore[attr-defined]
    ray.get = _absent  # type: ignore[attr-defined]
    sys.modules["ray"] = ray


def import_ray_trainer() -> types.ModuleType:
    """verl's ``verl.trainer.ppo.ray_trainer`` (``RayPPOTrainer``, ``compute_advantage``),
    imported without a Ray cluster: ray's submodules its import names, peft and accelerate
    (imported by verl's checkpoint and LoRA helpers, unused by the trainer methods the tests
    drive) stand in where they are not installed, and the CUDA-only ``flash_mla`` is hidden
    from Megatron's import as :mod:`tests.support.megatron_model` does.  The ray stand-ins
    stay for the session, like :func:`stub_ray`; peft's and accelerate's leave
    ``sys.modules`` once verl is imported."""
    # transformers records at import which optional packages exist (find_spec), and a stub
    # has no spec: it looks first, so it finds no accelerate, as without the stubs.
    import transformers.trainer_pt_utils  # noqa: F401

    from tests.support.megatron_model import _hide_broken_flash_mla
    from tests.support.stubs import stub_modules

    stub_ray()
    names = [
        "ray.experimental.state.api",
        "ray.util.placement_group",
        "ray.util.scheduling_strategies",
        "ray.actor",
        "peft.utils.save_and_load",
        "accelerate",
    ]
    added = {n: m for n, m in stub_modules(names).items() if n not in sys.modules}
    sys.modules.update(added)
    ray: Any = sys.modules["ray"]
    if getattr(ray, "__spec__", None) is None and not hasattr(ray, "remote"):
        ray.remote = lambda obj=None, **options: obj if obj is not None else (lambda o: o)
    _hide_broken_flash_mla()
    try:
        import verl.trainer.ppo.ray_trainer as ray_trainer
    finally:
        # verl's modules keep what they imported; later find_spec("peft") / ("accelerate")
        # calls (a stub has no spec: they would raise) see the machine as it is
        for name in added:
            if name.split(".")[0] != "ray":
                sys.modules.pop(name, None)
    return ray_trainer


class FakeGroup:
    """A process group of ``size`` ranks seen from rank ``rank`` (only size/rank are asked)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def import_megatron_engine() -> types.ModuleType:
    """verl's ``workers.engine.megatron.transformer_impl``, imported even where the other
    engines' dependencies are absent.

    ``verl/workers/engine/__init__.py`` imports the FSDP engine unconditionally, which needs
    ``peft`` (not installed: verl is ``--no-deps``).  Where that import fails, the package is
    put in ``sys.modules`` without running its ``__init__`` (its ``__path__`` and the two
    names it exports from ``base``), so the Megatron engine and the modules it imports load
    as they ship.
    """
    import importlib

    try:
        return importlib.import_module("verl.workers.engine.megatron.transformer_impl")
    except ModuleNotFoundError:
        pass
    for name in [m for m in sys.modules if m.startswith("verl.workers.engine")]:
        del sys.modules[name]  # a half-run __init__ left behind
    import verl.workers as workers

    spec = importlib.util.find_spec("verl.workers.engine")
    assert spec is not None and spec.submodule_search_locations is not None
    package = types.ModuleType("verl.workers.engine")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__package__ = "verl.workers.engine"
    sys.modules["verl.workers.engine"] = package
    workers.engine = package  # type: ignore[attr-defined]
    base = importlib.import_module("verl.workers.engine.base")
    package.BaseEngine = base.BaseEngine  # type: ignore[attr-defined]  # what __init__ exports
    package.EngineRegistry = base.EngineRegistry  # type: ignore[attr-defined]
    return importlib.import_module("verl.workers.engine.megatron.transformer_impl")


def verl_tensors(
    prompts_lens: Sequence[int],
    response_lens: Sequence[int],
    prompt_len: int,
    response_len: int,
    vocab: int,
    position_ids: Callable[[Any], Any],
) -> dict[str, Any]:
    """The tensors of the DataProto verl's agent loop hands the trainer: prompts left-,
    responses right-padded, random token ids (seed 0), ``position_ids`` by verl's own
    ``compute_position_id_with_mask`` (passed in: importing verl needs :func:`stub_ray`)."""
    import torch

    bs = len(prompts_lens)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.zeros(bs, prompt_len, dtype=torch.int64)
    responses = torch.zeros(bs, response_len, dtype=torch.int64)
    mask = torch.zeros(bs, prompt_len + response_len, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(prompts_lens, response_lens, strict=True)):
        prompts[i, prompt_len - p :] = torch.randint(1, vocab, (p,), generator=gen)
        responses[i, :r] = torch.randint(1, vocab, (r,), generator=gen)
        mask[i, prompt_len - p : prompt_len + r] = 1
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": mask,
        "response_mask": mask[:, prompt_len:].clone(),
        "position_ids": position_ids(mask),
    }


def router_shells(top_k_router: Any, router_replay: Any, layers: Sequence[int]) -> Any:
    """A model chunk of ``TopKRouter`` shells, one per 0-based layer id: each carries verl's
    ``RouterReplay`` and its ``layer_number``, all verl's ``iter_model_routers`` and
    ``set_router_replay_data`` read (the classes are passed in: importing them needs
    :func:`stub_ray` and Megatron's environment)."""
    import torch

    def shell(layer: int) -> Any:
        router = top_k_router.__new__(top_k_router)
        torch.nn.Module.__init__(router)
        router.layer_number = layer + 1
        router.router_replay = router_replay()
        return router

    return torch.nn.ModuleList([shell(layer) for layer in layers])
