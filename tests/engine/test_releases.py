"""What ``sglang_r3.releases`` decides per SGLang release, and the start-up's refusals.

No engine: the start-up check is called with a release put in place of the installed
one (``releases.current``), the way each process's check would see it.  The refusal of
AReaL 1.0.4's SGLang 0.5.10.post1 is one of them (docs/integrations.md, "AReaL and
SGLang 0.5.10.post1").
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_r3 import releases
from sglang_r3.config import ENV_CACHE
from sglang_r3.errors import StartupError
from sglang_r3.launch.startup import check_startup, release_problems
from sglang_r3.releases import Release


def _as_installed(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(releases, "current", lambda: Release(version))


@pytest.mark.parametrize("version", ["0.5.10.post1", "0.5.11", "0.5.24", "0.6.0"])
def test_start_up_refuses_a_release_outside_the_range(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    _as_installed(monkeypatch, version)
    monkeypatch.setenv(ENV_CACHE, "http://127.0.0.1:1")  # shipping on: refusals are errors
    with pytest.raises(StartupError) as err:
        check_startup([], None, [])
    message = str(err.value)
    assert "sglang_r3 supports SGLang >=0.5.12,<0.5.24" in message
    assert f"this is SGLang {version}" in message


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.5.10.post1", False),
        ("0.5.11", False),
        ("0.5.12", True),
        ("0.5.12.post1", True),
        ("0.5.15.post1", True),
        ("0.5.23", True),
        ("0.5.24", False),
    ],
)
def test_the_range(version: str, supported: bool) -> None:
    assert Release(version).supported is supported
    assert (releases.range_problem(Release(version)) is None) is supported


def _args(**on: object) -> SimpleNamespace:
    base = {
        "enable_hierarchical_cache": False,
        "tokenizer_worker_num": 1,
        "disaggregation_mode": "null",
        "speculative_algorithm": None,
    }
    return SimpleNamespace(**(base | on))


@pytest.mark.parametrize(
    ("option", "needle_012", "ok_on"),
    [
        ({"enable_hierarchical_cache": True}, "which SGLang has from 0.5.19 on", "0.5.19"),
        ({"tokenizer_worker_num": 2}, "which SGLang has from 0.5.23 on", "0.5.23"),
        ({"disaggregation_mode": "prefill"}, "verified on SGLang 0.5.23 only", "0.5.23"),
        ({"speculative_algorithm": "EAGLE"}, "verified on SGLang 0.5.23 only", "0.5.23"),
    ],
)
def test_an_option_a_release_lacks_is_refused_in_one_sentence_naming_the_release(
    monkeypatch: pytest.MonkeyPatch, option: dict[str, object], needle_012: str, ok_on: str
) -> None:
    _as_installed(monkeypatch, "0.5.12")
    problems = release_problems(_args(**option))
    assert len(problems) == 1 and needle_012 in problems[0], problems
    assert problems[0].endswith("this is SGLang 0.5.12"), problems
    _as_installed(monkeypatch, ok_on)
    assert release_problems(_args(**option)) == []
    assert release_problems(_args()) == []


def test_targets_move_where_the_wheels_say() -> None:
    old, new = Release("0.5.12"), Release("0.5.23")
    assert old.target(releases.T_COLLECT) == releases.T_COLLECT_MIXIN
    assert old.target(releases.T_RELEASE) == releases.T_RELEASE_METHOD
    assert old.target(releases.T_SERVE_GENERATE) is None
    assert old.target(releases.T_LAUNCH_DETOKENIZER) == releases.T_LAUNCH_DETOKENIZER
    assert new.targets(releases.ALL_TARGETS) == [
        t
        for t in releases.ALL_TARGETS
        if t not in (releases.T_LAUNCH_DETOKENIZER, releases.T_STREAM_OUTPUT)
    ]
    assert Release("0.5.13").target(releases.T_COLLECT) == releases.T_COLLECT
    fields = old.fields()["sglang.srt.managers.io_struct.GenerateReqInput"]
    assert "return_prompt_token_ids" not in fields and "data_parallel_rank" in fields
    assert (
        "data_parallel_rank"
        not in Release("0.5.16").fields()["sglang.srt.managers.io_struct.GenerateReqInput"]
    )
