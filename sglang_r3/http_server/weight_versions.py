"""Which weight version each row of an output was computed under, and where its rows are
cut into segments.

Runs in SGLang's HTTP process, on the tokenizer manager's event loop, when a finished
output is shipped (:mod:`sglang_r3.http_server.shipping`): plain functions of the
output's ``meta_info`` and its tag, no I/O.  A segment carries one weight version, so
an output whose weights changed while it ran is cut where they changed; a first turn's
prompt rows shared by a GRPO group are cut off on their own.
"""

from __future__ import annotations

from typing import Any

from sglang_r3.http_server.tagging import OutputTag

#: ``(first row, weight version)`` of each run of rows computed under one version, by
#: first row (the first run starts at row 0): :func:`version_runs`.
Versions = tuple[tuple[int, str], ...]


def version_runs(meta_info: dict[str, Any], prompt_len: int, default: str) -> Versions:
    """Which rows of an output were computed under which weight version.

    SGLang 0.5.23 reports ``meta_info["weight_versions"]``, spans of *output tokens*
    ``{"version", "start", "end"}``, when the weights changed while the request was
    running (``/pause_generation`` ``in_place`` or ``retract``, then an update).
    Output token ``i`` was sampled from the forward pass of position
    ``prompt_len + i - 1``, so a span starting at output token ``a > 0`` starts at row
    ``prompt_len + a - 1``; the prompt's rows belong to the first span.  With one
    version (the usual case) every row is ``default`` (the tag's version, else the
    engine's).  When there are several, the engine's names label every part: a
    tag's single version cannot describe rows computed under two.
    """
    spans = meta_info.get("weight_versions")
    if not isinstance(spans, list) or len({str(s.get("version")) for s in spans}) < 2:
        return ((0, default),)
    runs: list[tuple[int, str]] = []
    for span in sorted(spans, key=lambda s: int(s.get("start") or 0)):
        row = 0 if not runs else prompt_len + int(span["start"]) - 1
        version = str(span["version"])
        if runs and row <= runs[-1][0]:
            runs[-1] = (runs[-1][0], version)
        elif not runs or version != runs[-1][1]:
            runs.append((row, version))
    return tuple(runs)


def version_at(versions: Versions, row: int) -> str:
    """The weight version row ``row`` was computed under."""
    out = versions[0][1]
    for first, version in versions:
        if first > row:
            break
        out = version
    return out


def segment_cuts(
    tag: OutputTag, start: int, prompt_end: int, end: int, versions: Versions
) -> list[int]:
    """Segment boundaries of rows ``[start, end)``: one segment per weight version
    the rows were computed under, and a first turn's prompt rows on their own when
    shared."""
    cuts = {start, end}
    if tag.share_prompt and start == 0 < prompt_end < end:
        # The samples of a GRPO group (one request or one each) compute or read the
        # same prompt rows; stored as their own segment, the service keeps them once
        # for every rollout with the same rows.  Only from row 0: the service shares
        # by exact range and token prefix, so a later turn's part never matches
        # another rollout's, and splitting it would only add segments.
        cuts.add(prompt_end)
    cuts.update(row for row, _ in versions if start < row < end)
    return sorted(cuts)
