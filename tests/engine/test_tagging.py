"""sglang_r3.http_server.tagging: output tags from a request's sampling params, the id
rules applied before generation, request shapes, and the prompt-sharing policy."""

from __future__ import annotations

import pytest

from sglang_r3.config import EngineConfig
from sglang_r3.errors import R3RequestError
from sglang_r3.http_server.tagging import OutputTag, output_tags, request_shape


def tags(sp: object, batch: int = 1, n: int = 1) -> list[OutputTag] | None:
    return output_tags(sp, batch_size=batch, n=n, max_outputs=16)


def test_untagged_requests_have_no_tags() -> None:
    assert tags(None) is None
    assert tags({"max_new_tokens": 3}) is None
    assert tags({"custom_params": {"other": 1}}) is None
    assert tags([{"max_new_tokens": 1}, {}], batch=2) is None


def test_output_ids_follow_sglang_order() -> None:
    got = tags({"custom_params": {"r3": {"rollout_id": "g"}}}, batch=2, n=3)
    assert got is not None
    assert [(t.index, t.prompt_index, t.rollout_id) for t in got] == [
        (0, 0, "g-0"),
        (1, 0, "g-1"),
        (2, 0, "g-2"),
        (3, 1, "g-3"),
        (4, 1, "g-4"),
        (5, 1, "g-5"),
    ]
    assert all(t.share_prompt for t in got)
    one = tags({"custom_params": {"r3": {"rollout_id": "solo", "weight_version": "v7"}}})
    assert one is not None and one[0].rollout_id == "solo" and one[0].weight_version == "v7"
    assert not one[0].share_prompt
    per_prompt = tags(
        [
            {"custom_params": {"r3": {"rollout_id": "a"}}},
            {"custom_params": {"r3": {"rollout_id": ["b0", "b1"]}}},
        ],
        batch=2,
        n=2,
    )
    assert per_prompt is not None
    assert [t.rollout_id for t in per_prompt] == ["a-0", "a-1", "b0", "b1"]


@pytest.mark.parametrize(
    ("sp", "batch", "needle"),
    [
        ({"custom_params": {"r3": "x"}}, 1, "must be an object"),
        ([{"custom_params": {"r3": {"rollout_id": "a"}}}, {}], 2, "tag every prompt"),
        ({"custom_params": {"r3": {"rollout_id": [f"i{k}" for k in range(20)]}}}, 20, "exceed"),
        ({"custom_params": {"r3": {"rollout_id": "a/b"}}}, 1, "invalid rollout id"),
        ({"custom_params": {"r3": {"rollout_id": "a", "weight_version": 3}}}, 1, "weight_version"),
        # the format's rules, applied before generation (one rule, in r3_client)
        ({"custom_params": {"r3": {"rollout_id": "a", "weight_version": "v\x07"}}}, 1, "printable"),
        ({"custom_params": {"r3": {"rollout_id": "a", "weight_version": "v" * 257}}}, 1, "256"),
        ({"custom_params": {"r3": {"rollout_id": ".."}}}, 1, "invalid rollout id"),
        ({"custom_params": {"r3": {"rollout_id": ["ok", "."]}}}, 2, "invalid rollout id"),
        # ids derived as f"{id}-{k}" obey the rule too
        ({"custom_params": {"r3": {"rollout_id": "x" * 199}}}, 2, "derived from"),
        ({"custom_params": {"r3": {"rollout_id": "."}}}, 2, "invalid rollout id"),
    ],
)
def test_bad_tags(sp: object, batch: int, needle: str) -> None:
    with pytest.raises(R3RequestError) as err:
        tags(sp, batch=batch)
    assert err.value.status_code == 400 and needle in str(err.value)


def test_weight_version_rule_is_the_formats() -> None:
    """Up to 256 printable characters, as ``r3_client.check_text`` (and Segment) allow."""
    got = tags({"custom_params": {"r3": {"rollout_id": "a", "weight_version": "é" * 256}}})
    assert got is not None and got[0].weight_version == "é" * 256


def test_output_count_is_checked_before_ids_are_derived(monkeypatch: pytest.MonkeyPatch) -> None:
    """A huge ``n`` is refused before one id is derived (not after building them all)."""
    import sglang_r3.http_server.tagging as tagging

    derived: list[object] = []
    real = tagging._check_id
    monkeypatch.setattr(
        tagging, "_check_id", lambda i, *a, **k: derived.append(i) or real(i, *a, **k)
    )
    with pytest.raises(R3RequestError, match="exceed"):
        output_tags(
            {"custom_params": {"r3": {"rollout_id": "g"}}}, batch_size=1, n=10**4, max_outputs=16
        )
    assert derived == []


def test_request_shape() -> None:
    assert request_shape("w1 w2", None, {"n": 1}) == (1, 1, True)
    assert request_shape(None, [1, 2, 3], {"n": 4}) == (1, 4, False)
    assert request_shape(["a", "b"], None, None) == (2, 1, False)
    assert request_shape(None, [[1], [2], [3]], [{}, {}, {}]) == (3, 1, False)
    with pytest.raises(R3RequestError, match="embeddings"):
        request_shape(None, None, {})


def test_the_server_policy_decides_prompt_sharing_when_the_tag_does_not() -> None:
    def share(n: int, policy: str, **tag: object) -> bool:
        sp = {"custom_params": {"r3": {"rollout_id": "g", **tag}}}
        got = output_tags(sp, batch_size=1, n=n, max_outputs=16, share_prompt=policy)
        assert got is not None
        return got[0].share_prompt

    assert EngineConfig.from_env({}).share_prompt == "auto"
    assert EngineConfig.from_env({"SGLANG_R3_SHARE_PROMPT": "always"}).share_prompt == "always"
    assert [share(1, "auto"), share(2, "auto")] == [False, True]
    assert [share(1, "always"), share(2, "always")] == [True, True]
    assert [share(1, "never"), share(2, "never")] == [False, False]
    assert share(1, "never", share_prompt=True) and not share(2, "always", share_prompt=False)
