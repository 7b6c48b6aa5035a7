"""The README cannot rot: its commands exist and are the ones CI and make use.

Its Python quick starts run in tests/engine/test_readme.py (they need SGLang); `make demo`
runs shortened in tests/engine/test_demo.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_serve_flags_exist() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "cache_service", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in "\n".join(_blocks("console")).splitlines():
        if "r3 serve" not in line:
            continue
        for flag in re.findall(r"(--[a-z-]+)", line):
            assert flag in help_text, flag


def test_readme_launcher_flags_exist() -> None:
    """Every flag on a README launcher line is ours or SGLang's own."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from sglang_r3.launch_server import _parser

    sglang = argparse.ArgumentParser()
    ServerArgs.add_cli_args(sglang)
    known = set(_parser()._option_string_actions) | set(sglang._option_string_actions)
    lines = [
        line
        for block in _blocks("console")
        for line in block.splitlines()
        if "sglang_r3.launch_server" in line
    ]
    assert lines, "README shows how to launch the extension"
    for line in lines:
        for flag in re.findall(r"(--[a-z-]+)", line):
            assert flag in known, flag


def test_readme_tag_examples_are_valid_tags() -> None:
    """JSON blocks in the README are r3 tags the extension accepts."""
    import json

    from sglang_r3.http_server.tagging import output_tags

    blocks = _blocks("json")
    assert blocks
    for block in blocks:
        tag = json.loads(block)
        assert output_tags({"custom_params": {"r3": tag}}, batch_size=1, n=1, max_outputs=1)


def test_every_readme_command_is_checked() -> None:
    """Each console line is a command some test exercises; none is left unchecked."""
    checked = {
        "r3 serve": "test_readme_serve_flags_exist",
        "python -m sglang_r3.launch_server": "test_readme_launcher_flags_exist",
        "kubectl apply -k deploy/overlays/": "tests/deploy (renders and validates it)",
    }
    lines = [ln for block in _blocks("console") for ln in block.splitlines() if ln.strip()]
    assert lines
    for line in lines:
        cmd = line.removeprefix("$ ")
        assert any(cmd.startswith(c) for c in checked), f"unchecked README command: {line}"
        if cmd.startswith("kubectl"):
            overlay = cmd.split("-k", 1)[1].strip()
            assert (ROOT / overlay / "kustomization.yaml").exists(), overlay
            from tests.support.kustomize import VARIANTS

            assert overlay.removeprefix("deploy/") in {v[0] for v in VARIANTS.values()}


def test_readme_commands_are_the_make_targets_ci_runs() -> None:
    commands = [
        line.split("#")[0].strip() for block in _blocks("bash") for line in block.splitlines()
    ]
    assert "make test" in commands
    assert "make demo" in commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M), ".ci/run must call the README test command"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test:", makefile, flags=re.M)
    # `make demo` is `r3 demo`, which tests/engine/test_demo.py runs (shortened).
    assert re.search(r"^demo: bootstrap\n\t\$\(VENV\)/bin/r3 demo$", makefile, flags=re.M)


def test_codec_benchmark_runs_small() -> None:
    out = _run_bench(
        "codec_bench.py", "--tokens", "300", "--repeat", "1", "--shapes", "Qwen3-30B-A3B"
    )
    assert "### targets" in out
    assert "frame set-zstd" in out


def test_native_codec_baseline_benchmark_runs_small() -> None:
    """bench/native_codec_bench.py on a 256-row rollout: every figure of issue 29 printed."""
    out = _run_bench(
        "native_codec_bench.py", "--tokens", "256", "--repeat", "1", "--threads", "2",
        "--per-thread", "1",
    )  # fmt: skip
    assert "encode CPU / base64 CPU" in out
    assert "decode, 2 threads / 1 thread" in out
    assert "heartbeat longest gap, decode_frame" in out


def test_service_benchmark_runs_small() -> None:
    """bench/service_bench.py end to end on a tiny batch (it starts its own Redis and service)."""
    out = _run_bench(
        "service_bench.py",
        "--rollouts",
        "4",
        "--tokens",
        "256",
        "--repeat",
        "1",
        "--load-seconds",
        "1",
        "--load-clients",
        "2",
    )
    assert "HTTP POST /v1/batch/get" in out
    assert "load run: 0 errors" in out


def test_client_benchmark_runs_small() -> None:
    """bench/client_bench.py on 4 small rollouts: both paths agree, numbers printed."""
    out = _run_bench(
        "client_bench.py",
        "--rollouts",
        "4",
        "--prompt",
        "16",
        "--response",
        "48",
        "--repeat",
        "1",
        "--distinct",
        "2",
    )
    assert "speed-up" in out
    assert "identical (as sets)" in out


def test_client_construction_benchmark_runs_small() -> None:
    """bench/client_construction_bench.py: both kinds of client and their baselines timed."""
    out = _run_bench("client_construction_bench.py", "--clients", "3", "--repeat", "1")
    assert out.count("httpx default") == 2 and "async:" in out


def test_passthrough_benchmark_runs_quick() -> None:
    """bench/passthrough_bench.py --quick: every scenario, both distributions, a short load."""
    out = _run_bench("passthrough_bench.py", "--quick")
    for heading in ("### PUT", "### GET", "### Multi-turn", "### PUT throughput"):
        assert heading in out
    for scenario in ("| grpo | skewed", "| agent | uniform", "| single | skewed"):
        assert scenario in out
    assert "load run: 0 errors" in out


def test_lifecycle_benchmark_runs_quick(tmp_path: Path) -> None:
    """bench/lifecycle_bench.py --quick end to end (its own Redis and service): the engine's
    Shipper writes the step (a GRPO group, agents with a view), every way of removing it
    over both transports, shared as the engine puts it and private, checked and written;
    every key it made gone after (blobs included)."""
    out = _run_bench("lifecycle_bench.py", "--quick", "--json", str(tmp_path / "lb.json"))
    assert "`delete_many(ids)`" in out and "x one-by-one" in out and "fall / stored" in out
    import json

    report = json.loads((tmp_path / "lb.json").read_text())
    assert report["step"]["views"] > 0
    assert report["step"]["by_kind"] == {"grpo": 3, "agent": 1, "agent+view": 1}
    summary = report["summary"]
    assert {(s["mode"], s["transport"], s["phase"]) for s in summary} == {
        (m, t, p)
        for m in ("engine", "private")
        for t in ("http", "grpc")
        for p in ("one_by_one", "delete_many", "drop_consumed", "drop_bounded")
    }
    for s in summary:
        assert s["requests_client"] == s["requests_service"] > 0
        assert s["freed_reported_median"] > 0 and s["used_memory_fall_median"] > 0
        assert s["keys_left_max"] == 0
    blobs = {s["mode"]: s["stored_keys"].get("blobs", 0) for s in summary}
    assert blobs["engine"] >= 1 and blobs["private"] == 0  # the group's prompt, shared


def _run_bench(script: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout


def newcomer_map() -> dict[str, str]:
    """The README's map: folder -> what it says is there."""
    section = README.split("## A newcomer's map", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (.*) \|$", section, flags=re.M)
    return dict(rows)


def test_the_newcomers_map_matches_the_tree() -> None:
    """Every folder the map names exists, every file it names is in that folder, and every
    package folder of the product and of tests/ is on the map."""
    rows = newcomer_map()
    assert rows, "README has a newcomer's map"
    for folder, text in rows.items():
        assert (ROOT / folder).is_dir(), f"the map names {folder}, which does not exist"
        for name in re.findall(r"`([\w/]+\.(?:py|sh|md))`", text):
            assert (ROOT / folder / name).exists() or (ROOT / name).exists(), (folder, name)
    packages = {
        f"{init.parent.relative_to(ROOT)}/"
        for top in ("clients/r3_client", "cache_service", "sglang_r3", "tests/support")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert packages - set(rows) == set(), "package folders missing from the README's map"


def test_step_fetch_benchmark_runs_small(tmp_path: Path) -> None:
    """bench/step_fetch_bench.py end to end on a tiny step (its own Redis and service, rank
    processes): every figure issue 36 asks for is printed and written."""
    out = _run_bench(
        "step_fetch_bench.py", "--rollouts", "4", "--tokens", "2048", "--dp", "1", "--pp", "2",
        "--cp", "1", "--tp", "2", "--micro", "2", "--dist", "skewed", "--direct",
        "--short-tokens", "1100", "--json", str(tmp_path / "sfb.json"),
    )  # fmt: skip
    assert "bytes/share max" in out and "time ratio" in out and "DirectReader ranks" in out
    import json

    report = json.loads((tmp_path / "sfb.json").read_text())["skewed"]
    ranks = report["rank_local"]["ranks"]
    assert len(ranks) == 4 and all(r["bytes"] > 0 for r in ranks)
    assert report["rank_local"]["driver"]["rss_growth_mib"] < 64
    direct = report["direct"]["ranks"]  # what Redis sent each rank, one rank at a time
    assert len(direct) == 4 and all(r["how"] == "direct" and r["bytes"] > 0 for r in direct)
    short = report["short"]
    assert short["tokens"] == 1100 and short["service"]["max_bytes_over_share"] > 0
    assert short["direct"]["max_bytes_over_share"] > 0


def test_overlap_benchmark_runs_small(tmp_path: Path) -> None:
    """bench/overlap_bench.py end to end on a tiny run (its own Redis and service): every
    transport's step ratio and its fetch alone are printed and written."""
    out = _run_bench(
        "overlap_bench.py", "--rollouts", "4", "--tokens", "1024", "--dist", "skewed",
        "--ops", "200", "--steps", "2", "--warmup", "1", "--rounds", "1",
        "--json", str(tmp_path / "ob.json"),
    )  # fmt: skip
    assert "fetch alone direct" in out and "ratio" in out
    import json

    report = json.loads((tmp_path / "ob.json").read_text())["skewed"]["summary"]
    for transport in ("http", "grpc", "direct"):
        assert report[transport]["fetch_alone"]["median_ms"] > 0
        assert report[transport]["ratio_of_medians"] > 0
        assert report[f"{transport}-per-read"]["ratio_of_medians"] > 0  # the path before
