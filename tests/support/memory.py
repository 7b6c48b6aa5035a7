"""This process's resident memory, for the benchmarks' peak-growth figures (Linux /proc)."""

from __future__ import annotations

from pathlib import Path


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            got[line.split(":")[0]] = int(line.split()[1]) / 1024
    return got["VmRSS"], got["VmHWM"]


def reset_peak() -> float:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); the RSS then."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_mib()[0]
