"""``import r3_client`` must not load the transports (httpx, grpc, tqdm) or torch.

The SGLang plugin and trainers that only encode or decode import the package for
the format and codec; the clients load lazily on first access. Each check runs
in a fresh interpreter, since this test process has long since imported them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import r3_client

HEAVY = ("httpx", "grpc", "tqdm", "torch")
LAZY = ("RoutingClient", "AsyncRoutingClient")


def _run(code: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_import_and_codec_do_not_load_transports_or_torch() -> None:
    result = _run(
        f"""
        import json, sys
        import numpy as np
        import r3_client

        heavy = {HEAVY!r}
        after_import = [m for m in heavy if m in sys.modules]
        indices = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dtype=np.int32)
        data = r3_client.encode_frame(indices, num_experts=8, layer_ids=[0, 1])
        frame = r3_client.decode_frame(data)
        assert np.array_equal(frame.routing.indices, indices)
        after_codec = [m for m in heavy if m in sys.modules]
        print(json.dumps({{"after_import": after_import, "after_codec": after_codec}}))
        """
    )
    assert result == {"after_import": [], "after_codec": []}


def test_lazy_clients_still_resolve() -> None:
    result = _run(
        """
        import json, sys
        import r3_client

        before = "httpx" in sys.modules
        from r3_client import RoutingClient
        from r3_client._client import AsyncRoutingClient, RoutingClient as Direct

        print(json.dumps({
            "before": before,
            "same": RoutingClient is Direct,
            "async_same": r3_client.AsyncRoutingClient is AsyncRoutingClient,
            "httpx_after": "httpx" in sys.modules,
        }))
        """
    )
    assert result == {"before": False, "same": True, "async_same": True, "httpx_after": True}


def test_all_and_dir_list_every_name() -> None:
    names = set(dir(r3_client))
    for name in LAZY:
        assert name in r3_client.__all__
        assert name in names
    for name in r3_client.__all__:
        assert getattr(r3_client, name) is not None
    assert len(set(r3_client.__all__)) == len(r3_client.__all__)


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        r3_client.NoSuchThing  # noqa: B018
    assert not hasattr(r3_client, "NoSuchThing")


@pytest.mark.parametrize("old", ["r3_client.megatron", "r3_client.testing"])
def test_the_deprecated_module_aliases_are_gone(old: str) -> None:
    """``r3_client.megatron`` and ``r3_client.testing`` warned for one release (issue 28) and
    went in issue 43: their names now are ``r3_client.replay.megatron`` and
    ``r3_client.synthetic`` (docs/notes/module-map.md)."""
    import importlib

    with pytest.raises(ModuleNotFoundError, match=old.replace(".", r"\.")):
        importlib.import_module(old)
