"""Small helpers for talking to a real SGLang server in tests."""

from __future__ import annotations

import base64
import json
import os
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from sglang_r3.layers import moe_shape
from tests.support.service_process import Service, start_service

# The cache under the engines refuses segments over this many rows (413 test).
MAX_SEGMENT_ROWS = 512
CACHE_ENV = {"R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(MAX_SEGMENT_ROWS)}


def rid(prefix: str = "t") -> str:
    """A fresh rollout id."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def sp(rollout_id: Any = None, max_new_tokens: int = 6, **tag: Any) -> dict[str, Any]:
    """Greedy sampling params, tagged with ``rollout_id`` unless it is None."""
    out: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": 0}
    if rollout_id is not None:
        out["custom_params"] = {"r3": {"rollout_id": rollout_id, **tag}}
    return out


def generate(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, Any]:
    """POST /generate; (status, JSON)."""
    r = httpx.post(f"{url}/generate", json=body, timeout=timeout)
    return r.status_code, r.json()


def sse(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """POST a streaming request; the decoded ``data:`` events, ``[DONE]`` as the string."""
    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    events: list[Any] = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def inline_rows(out: dict[str, Any], num_layers: int, topk: int = 2) -> npt.NDArray[np.int32]:
    """Upstream's base64 routing of one output as ``[rows, all layers, K]``."""
    raw = base64.b64decode(out["meta_info"]["routed_experts"])
    return np.frombuffer(raw, dtype=np.int32).reshape(-1, num_layers, topk)


# A 3-layer, top-2-of-8 MoE: the shape of the rows crafted by the engine's unit tests.
SHAPE = moe_shape(SimpleNamespace(num_hidden_layers=3, num_experts_per_tok=2, num_experts=8))


def b64(rows: np.ndarray) -> str:
    """Rows as an engine answers them: base64 of the int32 array."""
    return base64.b64encode(rows.astype(np.int32).tobytes()).decode()


def as_sets(a: npt.ArrayLike) -> npt.NDArray[Any]:
    """Rows sorted within each (token, layer): routing compared as sets."""
    return np.sort(np.asarray(a, dtype=np.int64), axis=-1)


def restart_cache(cache: Service, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Start the engines' cache again on its ports and Redis (after a test killed it).

    ``cache`` (the ``engine_cache`` fixture) is updated in place, so every holder
    of it sees the new process.
    """
    restarted = start_service(
        tmp_path_factory.mktemp("engine-cache-restart"),
        cache.redis_url,
        env=CACHE_ENV,
        http_port=int(cache.http_url.rsplit(":", 1)[1]),
        grpc_port=int(cache.grpc_target.rsplit(":", 1)[1]),
    )
    cache.proc, cache.log = restarted.proc, restarted.log


SHIMS_DIR = Path(__file__).parents[1] / "engine" / "cpu_shims"


def shim_env(*shims: str, **extra: str) -> dict[str, str]:
    """Environment additions for an engine that needs the test-only CPU shims ``shims``
    (modules of ``r3_cpu_shims``), plus ``extra`` variables; for ``start_engine(env=...)``."""
    path = os.pathsep.join(p for p in (str(SHIMS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "R3_CPU_SHIMS": ",".join(shims), **extra}
