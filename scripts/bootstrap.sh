#!/usr/bin/env bash
# One-time set-up on a fresh machine: redis-server and promtool from Debian, a virtualenv, the
# package.
# Idempotent: re-running only installs what is missing.  Used by `make test` / `make demo`.
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${R3_EXTRAS:-all}"
# The CPU build of torch (a local wheel on this project's machines; a plain range would
# pull a multi-GB CUDA build). Override with R3_TORCH=torch==<version> elsewhere.
TORCH="${R3_TORCH:-torch==2.14.1}"
PYTHON="${PYTHON:-python3.11}"

# gcc builds the stub libcuda.so.1 that lets SGLang's kernels load on a CPU-only machine.
pkgs=""
command -v redis-server >/dev/null 2>&1 || pkgs="$pkgs redis-server"
command -v redis-cli >/dev/null 2>&1 || pkgs="$pkgs redis-tools"
command -v gcc >/dev/null 2>&1 || pkgs="$pkgs gcc libc6-dev"
# The pd test extra's Mooncake wheel links against these (RDMA verbs), even over TCP.
case ",$EXTRAS," in
  *,all,* | *,pd,*)
    for lib in libibverbs1:libibverbs.so.1 libnl-3-200:libnl-3.so.200 libnl-route-3-200:libnl-route-3.so.200; do
      # (grep without -q reads all of ldconfig's output: no SIGPIPE under pipefail)
      /sbin/ldconfig -p | grep -F "${lib#*:} " >/dev/null || pkgs="$pkgs ${lib%%:*}"
    done
    ;;
esac
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
if [ -n "$pkgs" ]; then
  echo "bootstrap: installing$pkgs from Debian" >&2
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $pkgs >/dev/null
fi

# libzstd's header: with it the compiled codec inflates set-zstd chunks itself (setup.py).
# Optional: where it cannot be installed, the codec decodes them chunk by chunk (a warning).
if [ ! -f /usr/include/zstd.h ]; then
  echo "bootstrap: installing libzstd-dev from Debian" >&2
  apt_get() { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get "$@"; }
  if ! { apt_get install -y -qq libzstd-dev >/dev/null 2>&1 ||
         { apt_get update -qq && apt_get install -y -qq libzstd-dev >/dev/null; }; }; then
    echo "bootstrap: warning: libzstd-dev not installed; set-zstd decodes chunk by chunk" >&2
  fi
fi

# promtool checks the monitoring component's alert rules and dashboard queries (tests/deploy).
# It comes with Debian's `prometheus` package, whose daemon we neither need nor leave on: a
# policy-rc.d (unless the machine has one) keeps the package from starting it, and it is
# disabled afterwards.
if ! command -v promtool >/dev/null 2>&1; then
  echo "bootstrap: installing prometheus from Debian (for promtool; the daemon stays off)" >&2
  policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod 755 "$policy"
  fi
  apt_ok=0
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null ||
    { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
      $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } ||
    apt_ok=$?
  if [ -n "$policy" ]; then $SUDO rm -f "$policy"; fi
  [ "$apt_ok" -eq 0 ] || { echo "bootstrap: installing prometheus failed" >&2; exit "$apt_ok"; }
  if command -v systemctl >/dev/null 2>&1; then $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
  if command -v update-rc.d >/dev/null 2>&1; then $SUDO update-rc.d prometheus disable >/dev/null 2>&1 || true; fi
fi

# tests/deploy render the manifests with `kubectl kustomize`; neither Debian nor PyPI
# ships kubectl, so it is a prerequisite of `make test` (not of `make demo`).
if ! command -v kubectl >/dev/null 2>&1; then
  echo "bootstrap: warning: kubectl not found; tests/deploy will fail until it is on PATH" >&2
fi

# Free disk before an environment is built: SGLang's CUDA-built torch and kernels make .venv
# about 11 GB and each release environment about 9.5 GB (measured on a fresh machine,
# docs/engine.md "Disk"); pip running out of space part-way leaves a broken venv and a
# one-line OSError, so say up front what is needed and what is there.
need_disk_gb() {
  local what="$1" gb="$2" free_kb
  free_kb="$(df -Pk . | awk 'NR == 2 {print $4}')"
  if [ "$free_kb" -lt $((gb * 1024 * 1024)) ]; then
    echo "bootstrap: $what needs about $gb GB free on the disk holding $(pwd); only $((free_kb / 1024 / 1024)) GB is free. Free some space (or set R3_EXTRAS to a smaller set of extras) and re-run." >&2
    exit 28
  fi
}

# (only for an environment not yet there: a re-install over one adds little)
if [ ! -x .venv/bin/python ]; then
  case ",$EXTRAS," in
    *,all,* | *,sglang,*) need_disk_gb ".venv with SGLang" 12 ;;
  esac
  echo "bootstrap: creating .venv with $PYTHON" >&2
  "$PYTHON" -m venv .venv
fi

# pip byte-compiles every module it installs in one process, ~5 ms a file: the two
# environments hold ~67,000 .py files (~5.5 min here).  So pip installs --no-compile and
# compile_venv compiles each environment once on every core.  Compiled they must be: with
# PYTHONDONTWRITEBYTECODE=1 (set on these machines) Python caches nothing on import, and
# every SGLang process would compile its thousands of modules again at each start.
NO_COMPILE=--no-compile
compile_venv() {
  # (Some packages ship files that are not Python 3, which pip's own compile step skips
  # the same way: compileall then exits 1 with everything else compiled.)
  "$1/bin/python" -m compileall -qq -j 0 "$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
}

# The stamp names pyproject.toml, setup.py, the compiled codec's source and whether libzstd's
# header is there: a change to any reinstalls (the editable install builds
# r3_client._kernels._r3codec in place).
stamp=".venv/.installed-$(cat pyproject.toml setup.py clients/r3_client/_kernels/_r3codec.c | sha256sum | cut -c1-16)-${EXTRAS//,/_}-${TORCH}$([ -f /usr/include/zstd.h ] && echo -zstd || true)"
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing sglang-r3[$EXTRAS] into .venv" >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q $NO_COMPILE -e ".[$EXTRAS]" "$TORCH"
  compile_venv .venv
  rm -f .venv/.installed-*
  touch "$stamp"
fi

# The test extras of tests/integrations and tests/engine/test_pd.py (pyproject.toml
# `verl`, `areal`, `pd`): installed --no-deps, as their comments say; only with `all`
# (what `make test` installs) or when asked for by name.  A stamp per extra, named by
# its package list, makes re-runs no-ops.
install_test_extra() {
  local name="$1" pkgs stamp
  case ",$EXTRAS," in
    *,all,* | *,"$name",*) ;;
    *) return 0 ;;
  esac
  pkgs="$(.venv/bin/python -c 'import sys, tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]))' "$name")"
  stamp=".venv/.$name-$(echo "$pkgs" | sha256sum | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    echo "bootstrap: installing the $name test extra (--no-deps): $pkgs" >&2
    .venv/bin/python -m pip install -q $NO_COMPILE --no-deps $pkgs
    compile_venv .venv
    rm -f ".venv/.$name-"*
    touch "$stamp"
  fi
}
install_test_extra verl
install_test_extra areal
install_test_extra pd

# Every other SGLang release the engine tests run (sglang_r3.releases.TESTED; .venv holds
# the newest), each in a virtualenv of its own with the torch that release pins (0.5.12:
# torch 2.11.0, a CUDA build from PyPI, ~9 GB): `.venv-sglang-<version>`.  This package
# goes in on top (`-e .[sglang]`), as into a framework's environment: pip keeps that
# SGLang and torch (tests/engine/test_release_install.py checks).  kernels==0.14.1:
# SGLang 0.5.12 requires `kernels` unpinned, and kernels 0.17 (the newest) cannot be
# imported beside its transformers 5.6.0 ("Either a revision or a version must be
# specified", transformers/integrations/hub_kernels.py:89).  Only with `all`.
case ",$EXTRAS," in
  *,all,*)
    for version in $(.venv/bin/python -c 'from sglang_r3.releases import TESTED; from importlib.metadata import version; print(*[v for v in TESTED if v != version("sglang")])'); do
      venv=".venv-sglang-$version"
      # pytest and pytest-timeout: tests/engine/test_release_canary.py runs the canary with
      # this environment's python (the versions are pyproject.toml's `dev` ranges).
      extra_pkgs="pytest>=8 pytest-timeout>=2.3"
      stamp="$venv/.installed-$( (cat pyproject.toml setup.py; echo "$extra_pkgs") | sha256sum | cut -c1-16)"
      if [ ! -f "$stamp" ]; then
        [ -x "$venv/bin/python" ] || need_disk_gb "$venv" 10
        echo "bootstrap: installing SGLang $version into $venv (its own torch; a few minutes)" >&2
        [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
        "$venv/bin/python" -m pip install -q $NO_COMPILE "sglang==$version" "kernels==0.14.1"
        "$venv/bin/python" -m pip install -q $NO_COMPILE -e ".[sglang]" $extra_pkgs
        compile_venv "$venv"
        rm -f "$venv"/.installed-*
        touch "$stamp"
      fi
    done
    ;;
esac
