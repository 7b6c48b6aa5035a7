"""A reader in its own process, for peak-memory checks: ``python reader_probe.py SPEC``.

SPEC is JSON: ``{"how": "http"|"grpc"|"direct"|"decode"|"stream", "url": ..., "key": ...,
"rollout": ..., "frame_file": ..., "budget": bytes}``.  The probe imports and warms up
the client, resets its peak RSS (``/proc/self/clear_refs``), caps its address space
at what it maps now plus ``budget`` (so a reader that would allocate without bound
dies with MemoryError instead of taking the machine), reads once, and prints JSON:
the error's class and message and the peak RSS growth in bytes.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
from pathlib import Path
from typing import Any


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) << 10 for ln in f if ln.startswith(field + ":"))


def _read(spec: dict[str, Any]) -> object:
    from r3_client import DirectReader, RoutingClient, decode_rollout

    how = spec["how"]
    if how == "decode":
        return decode_rollout(Path(spec["frame_file"]).read_bytes(), rollout_id=spec["rollout"])
    if how == "stream":  # what the readers did before issue 25: stream the frame open
        import zstandard

        return (
            zstandard.ZstdDecompressor()
            .decompressobj()
            .decompress(Path(spec["frame_file"]).read_bytes())
        )
    if how == "direct":
        with DirectReader.from_service(spec["url"], api_key=spec["key"]) as reader:
            ((_, got),) = reader.get_many([spec["rollout"]], return_errors=True)
        if isinstance(got, Exception):
            raise got
        return got
    with RoutingClient(spec["url"], api_key=spec["key"]) as client:
        return client.get(spec["rollout"])


def _warm_up(spec: dict[str, Any]) -> None:
    """Imports, connections and threads, so the peak measured is the read's own."""
    from r3_client import decode_rollout, encode_frame
    from r3_client.synthetic import synthetic_routing

    idx = synthetic_routing(64, 4, 64, 4, seed=0)
    decode_rollout(encode_frame(idx, num_experts=64, layer_ids=range(4), codec="set-zstd"))
    if spec["how"] not in ("decode", "stream"):
        with contextlib.suppress(Exception):  # any answer will do: it is not found
            _read({**spec, "rollout": "probe-warm-up-missing"})


def main() -> None:
    spec = json.loads(sys.argv[1])
    _warm_up(spec)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss0 = _status("VmRSS")
    cap = _status("VmSize") + int(spec["budget"])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    out: dict[str, object] = {}
    try:
        got = _read(spec)
        out["error"], out["message"] = None, f"read {type(got).__name__}"
    except BaseException as exc:  # MemoryError is what we are looking for
        out["error"], out["message"] = type(exc).__name__, str(exc)[:500]
    out["peak_growth"] = _status("VmHWM") - rss0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
