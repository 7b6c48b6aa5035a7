"""Rows kept at a retraction under overlap scheduling (``sglang_r3.scheduler.row_hooks``).

SGLang's overlap scheduler retracts a decoding request while the forward computing its
last token's position is still in flight; upstream then discards that forward's token for
the retracted request, and the re-prefill computes the position again before sampling the
next token.  The row the next token was sampled after is therefore the re-prefill's, and
every row before it is the one the kept tokens were sampled after.  These tests drive the
real hooks on SGLang's own ``BaseTopkCapturer`` in that order (the engine retracts on
demand only at its own pace, ``test_engine_e2e.py::test_retraction_is_marked_or_refused``
runs it for real), check where upstream 0.5.23 does what the hooks rely on, and check
that an order the hooks cannot store exactly is refused with a reason, never stored.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from sglang_r3.config import EngineConfig
from sglang_r3.errors import R3RequestError
from sglang_r3.http_server.views import split_computations
from sglang_r3.scheduler import hicache, row_hooks
from sglang_r3.scheduler.row_transport import EngineRows, TaggedRows, compact_rows
from tests.engine.test_ship_path import SHAPE, rows_for, tag
from tests.support.service_process import KEY_A, Service

LAYERS = 3
SLOTS = 64


@pytest.fixture
def capturer(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SGLang's own BaseTopkCapturer on CPU as the process's routed-experts capturer, a
    fresh in-flight order, and the extension enabled in this process."""
    import torch
    from sglang.srt.state_capturer import routed_experts
    from sglang.srt.state_capturer.base import BaseTopkCapturer

    from sglang_r3.cpu.allocator import install_allocator

    install_allocator()
    cap = BaseTopkCapturer(
        num_tokens=SLOTS, max_batch_size=16, num_layers=LAYERS, topk_size=2, device="cpu", name="t"
    )
    monkeypatch.setattr(routed_experts, "get_global_experts_capturer", lambda: cap)
    monkeypatch.setattr(hicache, "_MOVER", hicache._RowMover())
    monkeypatch.setattr(row_hooks, "engine_config", lambda: SimpleNamespace(enabled=True))
    monkeypatch.setattr(row_hooks, "_marks_rows", lambda: True)
    cap.torch = torch
    return cap


class Engine:
    """One tagged request's life on the capturer: slots, forwards, retractions."""

    def __init__(self, cap: Any, prompt: int) -> None:
        import torch

        self.cap, self.torch = cap, torch
        self.pool = SimpleNamespace(req_to_token=torch.zeros((2, SLOTS), dtype=torch.int64))
        self.next_slot = 0
        self.in_flight: list[Any] = []
        self.req = _Req(prompt)
        self.expert: dict[int, int] = {}  # position -> expert of its latest computation

    def _slot(self, pos: int) -> int:
        slot = self.next_slot
        self.next_slot += 1
        self.pool.req_to_token[0, pos] = slot
        return slot

    def forward(self, positions: range, expert: int, overlap: bool = True) -> Any:
        """Compute ``positions`` with expert ``expert`` in every layer; under ``overlap``
        the rows land at ``finalize()`` (call :meth:`land`)."""
        from sglang.srt.state_capturer.base import BaseTopkCapturer

        slots = [self._slot(p) for p in positions]
        for p in positions:
            self.expert[p] = expert
        ids = self.torch.tensor([[expert, expert + 1]] * len(slots), dtype=self.torch.int32)
        for layer in range(LAYERS):
            self.cap.capture(layer, ids)
        batch = SimpleNamespace(out_cache_loc=self.torch.tensor(slots), out_cache_loc_virtual=None)
        self.req.kv.kv_committed_len = positions.stop
        out = hicache.around_capture_forward_end(
            BaseTopkCapturer.on_forward_end,
            self.cap,
            forward_batch=batch,
            can_run_graph=False,
            cuda_graph_batch=None,
            no_copy_to_cpu=overlap,
        )
        if out is not None:
            self.in_flight.append(out)
        return out

    def land(self) -> None:
        """The scheduler processes the oldest forward in flight (``finalize()``)."""
        from sglang.srt.state_capturer.base import TopkCaptureOutput

        hicache.around_capture_finalize(TopkCaptureOutput.finalize, self.in_flight.pop(0))

    def prefill(self, prefix: int, expert: int) -> None:
        """A prefill (first or re-prefill) from the radix hit ``prefix``, then sample."""
        self.req.prefix_len = prefix
        row_hooks.before_prepare_for_extend(SimpleNamespace(reqs=[self.req]))
        self.forward(range(prefix, self.req.seqlen), expert)

    def retract(self) -> None:
        row_hooks.around_release_req(lambda **kw: None, req=self.req, req_to_token_pool=self.pool)
        self.req.retraction_count += 1

    def collect(self) -> TaggedRows:
        """The finished request's rows from ``routed_experts_start_len``, as upstream's
        ``_maybe_collect_routed_experts`` gathers them, through the extension's hook."""

        def original(_self: Any, req: Any) -> None:
            slots = self.pool.req_to_token[0, req.routed_experts_start_len : req.seqlen - 1]
            req.routed_experts = self.cap.host_cache.buffer[slots].clone()

        row_hooks.around_collect_routed_experts(original, None, self.req)
        rows = self.req.routed_experts
        assert isinstance(rows, TaggedRows)
        return rows


class _Req:
    def __init__(self, prompt: int) -> None:
        self.origin_input_ids = list(range(prompt))
        self.output_ids: list[int] = []
        self.sampling_params = SimpleNamespace(custom_params={"r3": {"rollout_id": "x"}})
        self.retraction_count = 0
        self.prefix_len = 0
        self.routed_experts_start_len = 0
        self.routed_experts: Any = None
        self.rid = "req"
        self.kv = SimpleNamespace(req_pool_idx=0, kv_committed_len=0)

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return False


def _experts(rows: np.ndarray) -> list[int]:
    """The expert of each row (every layer holds ``[e, e + 1]``)."""
    assert (rows[:, :, 1] == rows[:, :, 0] + 1).all() and (rows == rows[:, :1]).all()
    return [int(e) for e in rows[:, 0, 0]]


def _decode(engine: Engine, steps: int, first_expert: int) -> None:
    """Overlapped decode: each step launches the next forward before the previous one's
    token is processed (the token appended when its forward lands)."""
    for i in range(steps):
        engine.forward(range(engine.req.seqlen - 1, engine.req.seqlen), first_expert + i)
        engine.land()
        engine.req.output_ids.append(100 + len(engine.req.output_ids))


def test_a_retraction_with_a_decode_in_flight_keeps_exactly_the_rows_tokens_followed(
    capturer: Any,
) -> None:
    """Prompt of 6 (positions 0-5), 4 tokens decoded, then retracted while the forward
    computing position 9 (the 4th token's KV) is in flight: upstream discards its token.
    Re-prefilled from the radix hit at 3, decoded 3 more tokens.  Every position's stored
    first computation is the computation the next kept token was sampled after, and the
    in-flight forward's row is nowhere."""
    eng = Engine(capturer, prompt=6)
    eng.prefill(0, expert=10)
    eng.land()
    eng.req.output_ids.append(100)  # sampled after position 5 (expert 10)
    _decode(eng, 3, first_expert=20)  # positions 6, 7, 8 -> experts 20, 21, 22
    assert eng.req.seqlen == 10
    eng.forward(range(9, 10), expert=50)  # in flight: position 9
    eng.retract()
    eng.land()  # the in-flight forward lands; upstream drops its token (is_retracted)
    assert eng.req.seqlen == 10  # nothing appended
    eng.prefill(3, expert=30)  # re-prefill of positions 3..9 -> expert 30
    eng.land()
    eng.req.output_ids.append(200)  # sampled after the re-prefill's position 9
    _decode(eng, 2, first_expert=40)  # positions 10, 11
    rows = compact_rows(eng.collect())
    assert rows.problem is None
    assert rows.snapshots[0][0] == 9  # rows [0, 9): position 9 was in flight, left out
    split = split_computations(rows.array, rows.first or 0, 0, rows.epochs, rows.snapshots)
    # Each first computation: what the token after it was sampled after.
    assert _experts(split.rows) == [10] * 6 + [20, 21, 22] + [30] + [40, 41]
    assert 50 not in _experts(split.rows)
    (view,) = split.views
    assert (view.start, view.end, view.serves) == (3, 9, 9)
    assert _experts(view.rows) == [30] * 6
    assert split.cuts == (9,)


def test_pause_retract_processes_the_forward_in_flight_first(capturer: Any) -> None:
    """``/pause_generation`` ``retract`` lands the forward in flight and appends its token
    before it retracts: that forward's row is inside the kept rows."""
    eng = Engine(capturer, prompt=4)
    eng.prefill(0, expert=10)
    eng.land()
    eng.req.output_ids.append(100)
    eng.forward(range(4, 5), expert=20)  # in flight
    eng.land()  # pause_generation: process_batch_result first
    eng.req.output_ids.append(101)
    eng.retract()
    eng.prefill(0, expert=30)  # after a push: the whole prefix recomputed
    eng.land()
    eng.req.output_ids.append(102)
    rows = compact_rows(eng.collect())
    assert rows.problem is None and rows.snapshots[0][0] == 5
    split = split_computations(rows.array, 0, 0, rows.epochs, rows.snapshots)
    assert _experts(split.rows) == [10] * 4 + [20] + [30]
    (view,) = split.views
    assert (view.start, view.end, view.serves) == (0, 5, 5)


def test_a_chunked_prefill_cut_short_keeps_only_the_rows_it_computed(capturer: Any) -> None:
    """A pause retracts a prompt whose chunked prefill computed 4 of its 10 positions: the
    slots past them hold another request's rows and are never read."""
    eng = Engine(capturer, prompt=10)
    eng.pool.req_to_token[0, :] = 63  # another request's slot, left in the row
    capturer.host_cache.buffer[63] = 7
    eng.req.prefix_len = 0
    row_hooks.before_prepare_for_extend(SimpleNamespace(reqs=[eng.req]))
    eng.forward(range(0, 4), expert=10)  # the first chunk
    eng.land()
    eng.retract()
    eng.prefill(0, expert=30)
    eng.land()
    eng.req.output_ids.append(100)
    rows = compact_rows(eng.collect())
    assert rows.problem is None and rows.snapshots[0][0] == 4
    split = split_computations(rows.array, 0, 0, rows.epochs, rows.snapshots)
    assert 7 not in _experts(split.rows)
    assert _experts(split.rows) == [10] * 4 + [30] * 6


def test_a_token_kept_past_the_rows_kept_is_refused(capturer: Any) -> None:
    """Were the token of the forward in flight kept (not upstream 0.5.23's order), the row
    it was sampled after would be lost: the output carries a problem, not a guess."""
    eng = Engine(capturer, prompt=4)
    eng.prefill(0, expert=10)
    eng.land()
    eng.req.output_ids.append(100)
    eng.forward(range(4, 5), expert=20)
    eng.retract()
    eng.land()
    eng.req.output_ids.append(101)  # kept anyway
    eng.prefill(2, expert=30)
    eng.land()
    eng.req.output_ids.append(102)
    rows = eng.collect()
    assert rows.problem and "resumed with 2 output tokens, 1 when it was retracted" in (
        rows.problem
    )
    assert compact_rows(rows).problem == rows.problem


def test_rows_that_never_landed_are_refused(capturer: Any) -> None:
    eng = Engine(capturer, prompt=4)
    eng.prefill(0, expert=10)
    eng.land()
    eng.req.output_ids.append(100)
    eng.forward(range(4, 5), expert=20)
    eng.retract()  # the in-flight forward never lands
    eng.req.retraction_count = 1
    rows = eng.collect()
    assert rows.problem and "never landed" in rows.problem


async def test_the_shipper_refuses_a_problem_and_stores_nothing(engine_cache: Service) -> None:
    from r3_client import AsyncRoutingClient, RolloutNotFoundError
    from sglang_r3.http_server.shipping import Shipper

    ship = Shipper(EngineConfig(routing_cache=engine_cache.http_url, api_key=KEY_A), SHAPE, "t")
    rollout = f"retract-refused-{np.random.default_rng().integers(1 << 30)}"
    rows = rows_for(30, seed=2)
    routing = EngineRows(rows, 0, (0,), (), problem="r3: rows lost at a retraction")
    with pytest.raises(R3RequestError) as err:
        await ship.ship(
            tag(rollout), 0, routing, list(range(20)), list(range(20, 31)), {}, assumed_new=True
        )
    assert err.value.status_code == 500 and "rows lost at a retraction" in str(err.value)
    async with AsyncRoutingClient(engine_cache.http_url, api_key=KEY_A) as client:
        with pytest.raises(RolloutNotFoundError):
            await client.stat(rollout)
    await ship.client.aclose()


def test_upstream_order_the_hooks_rely_on() -> None:
    """SGLang 0.5.23: a retracted request's in-flight decode token is dropped, and a pause
    with ``retract`` processes the forward in flight before retracting."""
    from sglang.srt.managers import scheduler
    from sglang.srt.managers.schedule_batch import ReqKvInfo
    from sglang.srt.managers.scheduler_components import batch_result_processor

    decode = inspect.getsource(
        batch_result_processor.SchedulerBatchResultProcessor.process_batch_result_decode
    )
    assert "req.finished() or req.is_retracted" in decode
    skip = decode.index("req.finished() or req.is_retracted")
    assert decode.index("continue", skip) < decode.index("req.output_ids.extend", skip)
    pause = inspect.getsource(scheduler.Scheduler.pause_generation)
    assert pause.index("self.process_batch_result(") < pause.index("retract_all(")
    names = {f for f in ReqKvInfo.__dataclass_fields__}
    assert {"req_pool_idx", "kv_committed_len"} <= names
