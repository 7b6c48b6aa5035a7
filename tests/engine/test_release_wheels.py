"""Every supported SGLang release judged by its own wheel, with no engine and no import.

:mod:`sglang_r3.releases` says where each hook target is in a release and which upstream
fields it lacks.  Here each release's wheel (``pip download --no-deps``, cached in
``$R3_WHEEL_CACHE`` or ``~/.cache/sglang-r3/wheels``) is read statically
(:mod:`tests.support.wheel_resolve`): every target and field the table gives for that
release must be in it, every gap the table gives must be a real one, and a release
outside the range must fail the same check by name.  A new release on PyPI inside the
range fails :func:`test_every_release_in_range_is_judged` until it is listed here.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sglang_r3.releases import (
    ALL_TARGETS,
    FIELD_GAPS,
    FIRST,
    PAST,
    SUPPORTED,
    WORKAROUNDS,
    Release,
    parse,
)
from sglang_r3.targets import T_CAPTURE_END
from tests.support.wheel_resolve import Wheel

#: Every release on PyPI inside :data:`sglang_r3.releases.SUPPORTED`.
RELEASES = [
    "0.5.12",
    "0.5.12.post1",
    "0.5.13",
    "0.5.13.post1",
    "0.5.14",
    "0.5.15",
    "0.5.15.post1",
    "0.5.16",
    "0.5.17",
    "0.5.18",
    "0.5.19",
    "0.5.20",
    "0.5.21",
    "0.5.22",
    "0.5.23",
]

#: Releases below the range, with names the check must find missing there.
OUTSIDE = {
    "0.5.11": (T_CAPTURE_END,),  # the capturer is layers/moe/routed_experts_capturer.py
    "0.5.10.post1": (T_CAPTURE_END, "sglang.srt.plugins"),  # no plugin loader at all
}

_SB = "sglang.srt.managers.schedule_batch"
#: What the scheduler hooks read besides their targets (``sglang_r3.scheduler.row_hooks``,
#: ``sglang_r3.hooks``), by when: ``""`` every release, ``"cap"`` where the release has
#: capability ``cap``, ``"!cap"`` where it lacks it.  Attributes of ``Req`` count when
#: ``Req.__init__`` assigns them.  Each capability's two sides pin its first release:
#: the old attribute leaves the wheel in the release the new one arrives.
READS: dict[str, tuple[str, ...]] = {
    "": (
        "sglang.srt.plugins.hook_registry.HookRegistry",
        "sglang.srt.plugins.hook_registry.HookType",
        "sglang.srt.state_capturer.routed_experts.get_global_experts_capturer",
        "sglang.srt.sampling.sampling_params.SamplingParams.custom_params",
        f"{_SB}.ScheduleBatch.reqs",
        *(
            f"{_SB}.Req.{name}"
            for name in (
                "rid",
                "origin_input_ids",
                "output_ids",
                "sampling_params",
                "retraction_count",
                "routed_experts",
                "routed_experts_start_len",
                "finished",
            )
        ),
    ),
    # releases.req_kv: Req.kv.req_pool_idx / kv_committed_len, else on the Req itself
    "req_kv_info": (
        f"{_SB}.Req.kv",
        f"{_SB}.ReqKvInfo.req_pool_idx",
        f"{_SB}.ReqKvInfo.kv_committed_len",
    ),
    "!req_kv_info": (f"{_SB}.Req.req_pool_idx", f"{_SB}.Req.kv_committed_len"),
    # releases.req_prefix_len: Req.prefix_len, else len(Req.prefix_indices)
    "req_prefix_len": (f"{_SB}.Req.prefix_len",),
    "!req_prefix_len": (f"{_SB}.Req.prefix_indices",),
    # row_hooks.around_release_req_method reads the batch's pool
    "!release_req_function": (f"{_SB}.ScheduleBatch.req_to_token_pool",),
}


def _cache() -> Path:
    return Path(os.environ.get("R3_WHEEL_CACHE") or Path.home() / ".cache/sglang-r3/wheels")


def _download(version: str) -> Path:
    """The cached wheel of SGLang ``version``, downloaded (not installed) if missing."""
    cache = _cache()
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        done = subprocess.run(
            [*cmd, "-q", f"sglang=={version}", "-d", tmp],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        wheels = list(Path(tmp).glob(f"sglang-{version}-*.whl"))
        if done.returncode or not wheels:
            pytest.fail(
                f"pip download --no-deps sglang=={version} gave no wheel "
                f"(rc {done.returncode}): {done.stderr[-2000:]}"
            )
        target = cache / wheels[0].name
        os.replace(wheels[0], target)  # whole or not at all, for a parallel run
    return target


@functools.cache
def _wheel(version: str) -> Wheel:
    wheel = Wheel(_download(version))
    assert wheel.version == version, f"{wheel.path} is SGLang {wheel.version}, not {version}"
    return wheel


def _problems(wheel: Wheel, names: list[str], *, instance: bool = False) -> list[str]:
    return [p for p in (wheel.problem(n, instance=instance) for n in names) if p]


def _fields(release: Release) -> list[str]:
    return [f"{owner}.{f}" for owner, names in release.fields().items() for f in names]


def _applies(release: Release, when: str) -> bool:
    return not when or release.has(when.lstrip("!")) != when.startswith("!")


@pytest.mark.parametrize("version", RELEASES)
def test_targets_resolve(version: str) -> None:
    """Every hook target the table gives for the release is in its wheel."""
    release = Release(version)
    assert release.supported, f"SGLang {version} is outside {SUPPORTED}"
    problems = _problems(_wheel(version), release.targets(ALL_TARGETS))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", RELEASES)
def test_fields_exist(version: str) -> None:
    """Every upstream field the table says the release has is on its owner there."""
    problems = _problems(_wheel(version), _fields(Release(version)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", RELEASES)
def test_hook_reads_exist(version: str) -> None:
    """What the scheduler hooks read on the release's side of each capability is there."""
    release = Release(version)
    names = [n for when, names in READS.items() if _applies(release, when) for n in names]
    problems = _problems(_wheel(version), names, instance=True)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", RELEASES)
def test_gaps_are_real(version: str) -> None:
    """What the table says the release lacks (a field, or a target it hooks elsewhere or
    not at all) is really missing from its wheel, so no hook or read is left out where
    upstream has it."""
    release, wheel = Release(version), _wheel(version)
    lacked = [
        f"{owner}.{field}"
        for (owner, field), gaps in FIELD_GAPS.items()
        if any(first <= release.key < past for first, past in gaps)
    ]
    # (a workaround's target may stay upstream after the release that needs no hook)
    moved = [t for t in ALL_TARGETS if release.target(t) != t and t not in WORKAROUNDS]
    present = [f"{n} ({wheel.find(n)})" for n in lacked + moved if wheel.problem(n) is None]
    assert not present, f"sglang_r3.releases says SGLang {version} lacks, but it has: {present}"


@pytest.mark.parametrize("version", list(OUTSIDE))
def test_outside_range_fails(version: str) -> None:
    """The same check fails on a release below the range, naming what is missing."""
    release, wheel = Release(version), _wheel(version)
    assert not release.supported
    problems = _problems(wheel, release.targets(ALL_TARGETS))
    assert problems, f"every target resolves in SGLang {version}: the check judges nothing"
    for name in OUTSIDE[version]:
        message = wheel.problem(name)
        assert message is not None, f"{name} is in SGLang {version}"
        assert name in message and f"SGLang {version}" in message, message
        assert name not in ALL_TARGETS or message in problems, (message, problems)


def test_every_release_in_range_is_judged() -> None:
    """Every release PyPI has inside the range is in :data:`RELEASES`."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "sglang"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("Available versions:")]
    if done.returncode or not lines:
        pytest.fail(
            "`pip index versions sglang` gave no list of releases (needs the package index; "
            f"rc {done.returncode}): {done.stderr[-2000:]}"
        )
    published = [v.strip() for v in lines[0].split(":", 1)[1].split(",")]
    in_range = {v for v in published if FIRST <= parse(v) < PAST}
    assert not in_range - set(RELEASES), (
        f"SGLang releases on PyPI in {SUPPORTED} that this test does not judge: "
        f"{sorted(in_range - set(RELEASES))}; add them to RELEASES"
    )
    assert all(Release(v).supported for v in RELEASES)
    assert not any(Release(v).supported for v in OUTSIDE)
