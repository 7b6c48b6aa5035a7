"""sglang_r3.http_server.output_rows: the guards on the routing rows an engine answers with."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from sglang_r3.errors import R3RequestError
from sglang_r3.http_server.output_rows import check_engine_rows, decode_rows
from tests.support.engine_requests import SHAPE, b64


def test_row_guards() -> None:
    rows = np.tile(np.array([1, 2], np.int32), (5, 3, 1))
    assert decode_rows(b64(rows), SHAPE).shape == (5, 3, 2)
    check_engine_rows(decode_rows(b64(rows), SHAPE), 5)
    with pytest.raises(R3RequestError, match="5 routing rows for 6 token positions"):
        check_engine_rows(rows, 6)
    with pytest.raises(R3RequestError, match="not a whole number"):
        decode_rows(base64.b64encode(b"\0" * 20).decode(), SHAPE)
