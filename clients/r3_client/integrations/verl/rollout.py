"""verl rollout side (the agent-loop workers): each trajectory tagged by a fresh rollout id,
every ``generate`` of its turns carrying it to SGLang (the package docstring says how)."""

from __future__ import annotations

import importlib
import uuid
from typing import TYPE_CHECKING, Any

from r3_client._exceptions import FrameworkImportError, InvalidRequestError, UsageError
from r3_client._routing import check_rollout_id
from r3_client.integrations.tags import tag_sampling_params
from r3_client.integrations.verl._keys import ROLLOUT_ID_KEY

if TYPE_CHECKING:
    pass


def new_rollout_id(prefix: str = "verl") -> str:
    """A fresh rollout id, ``f"{prefix}.{uuid4().hex}"``; the prefix names the run in the
    cache (InvalidRequestError when it makes an id the cache would refuse)."""
    return check_rollout_id(f"{prefix}.{uuid.uuid4().hex}")


class TaggingServerClient:
    """verl's ``LLMServerClient`` with every ``generate`` tagged with one rollout id.

    Wraps the agent loop's ``server_manager`` for one trajectory; every other attribute
    is the wrapped one's.
    """

    def __init__(self, wrapped: Any, rollout_id: str, *, share_prompt: bool | None = None) -> None:
        self.wrapped = wrapped
        self.rollout_id = check_rollout_id(rollout_id)
        self.share_prompt = share_prompt

    async def generate(
        self, request_id: Any, *, sampling_params: dict[str, Any], **kwargs: Any
    ) -> Any:
        """The wrapped ``generate`` with ``sampling_params["custom_params"]["r3"]`` set (a
        copy: verl reuses the caller's dict across turns)."""
        params = tag_sampling_params(
            sampling_params, self.rollout_id, share_prompt=self.share_prompt
        )
        return await self.wrapped.generate(request_id, sampling_params=params, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)


def _check_rollout_config(rollout: Any) -> None:
    """Refuse a rollout config under which tagged requests would not store routing or
    verl would misread the answer."""
    name = getattr(rollout, "name", None)
    if name != "sglang":
        raise InvalidRequestError(
            f"r3 tags SGLang requests; actor_rollout_ref.rollout.name is {name!r}, not 'sglang'"
        )
    if getattr(rollout, "enable_rollout_routing_replay", False):
        raise InvalidRequestError(
            "set actor_rollout_ref.rollout.enable_rollout_routing_replay=False: the engine "
            "ships a tagged request's routing to the cache and answers without the inline "
            "routing verl would then read (async_sglang_server.py:641, 682-698); "
            "r3_client.integrations.verl.attach_routed_experts fills the field instead"
        )


class RoutedAgentLoop:
    """Mixin for a verl ``AgentLoopBase`` subclass: each ``run`` is one rollout.

    Put it first among the bases (``class R3ToolAgentLoop(RoutedAgentLoop,
    ToolAgentLoop)``).  ``run`` makes a rollout id (:func:`new_rollout_id` with
    ``r3_prefix``), tags every ``self.server_manager.generate`` of the trajectory with
    it (:class:`TaggingServerClient`, ``share_prompt`` from ``r3_share_prompt``) and
    returns it in ``output.extra_fields["r3_rollout_id"]``.
    """

    r3_prefix: str = "verl"
    r3_share_prompt: bool | None = None
    server_manager: Any
    rollout_config: Any

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        """The agent loop's own ``run``, its requests tagged with a new rollout id."""
        _check_rollout_config(self.rollout_config)
        rollout_id = new_rollout_id(self.r3_prefix)
        inner = self.server_manager
        self.server_manager = TaggingServerClient(
            inner, rollout_id, share_prompt=self.r3_share_prompt
        )
        try:
            output = await super().run(sampling_params, **kwargs)  # type: ignore[misc]
        finally:
            self.server_manager = inner
        output.extra_fields[ROLLOUT_ID_KEY] = rollout_id
        return output


_ROUTED: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    """``cls`` with :class:`RoutedAgentLoop` first among its bases (made once per class)."""
    if issubclass(cls, RoutedAgentLoop):
        return cls
    if cls not in _ROUTED:
        _ROUTED[cls] = type(
            f"Routed{cls.__name__}", (RoutedAgentLoop, cls), {"__module__": __name__}
        )
    return _ROUTED[cls]


def _locate(path: str) -> type:
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise FrameworkImportError(
            f"agent_loop={path!r}: cannot import {name!r} from {module!r} ({exc})"
        ) from exc
    if not isinstance(cls, type):
        raise UsageError(f"agent_loop={path!r} is not a class")
    return cls


def routed_agent_loop(
    agent_loop: str,
    *,
    prefix: str = "verl",
    share_prompt: bool | None = None,
    **kwargs: Any,
) -> Any:
    """An instance of ``agent_loop`` (a dotted class path) made a :class:`RoutedAgentLoop`.

    The ``_target_`` of an entry in verl's agent-loop config file: verl's worker
    instantiates the entry per sample with hydra, passing the entry's other keys
    (``agent_loop``, ``prefix``, ``share_prompt``) and its own constructor arguments
    (``agent_loop.py:682-692``), which go to the class.
    """
    check_rollout_id(f"{prefix}.0")  # a bad prefix fails here, not on the first request
    obj = _routed_class(_locate(agent_loop))(**kwargs)
    obj.r3_prefix = prefix
    obj.r3_share_prompt = share_prompt
    return obj
