"""Every series deploy/components/monitoring reads exists where it is scraped, with the labels
its expressions use.

One run against the real processes: the GLM engine (its scheduler retracts in this test
mode) ships to the cache while the cache is down (a ship failure, routing returned
inline), then, the cache restarted, stores a turn, recomputes it after a radix flush (a
view) and refuses a retracted batch (a guard); the trainer reads a batch, checks a step
with views and deletes a rollout.  Then the cache's ``/metrics``, the engine's
``/r3/metrics`` and the trainer process's default registry are scraped, and each series a
dashboard panel, a dashboard variable or an alert names (``monitoring_selectors``) must be
exported, every label it uses on at least one sample: a labelled counter appears only once
counted, so the run must produce what the dashboard is about.
"""

from __future__ import annotations

import signal

import httpx
import pytest
from prometheus_client import REGISTRY

from r3_client import RoutingClient
from r3_client.rank_local import check_step
from sglang_r3.tools.local_stack import EngineServer
from tests.deploy.monitoring_exprs import monitoring_selectors, rule_groups
from tests.support.engine_requests import generate, restart_cache, rid, sp
from tests.support.prometheus import label_names, registry_text, value
from tests.support.service_process import METRICS_KEY, Service

pytestmark = pytest.mark.timeout(600)


def _run(engine: EngineServer, cache: Service, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The run described above; the rollout that got a view."""
    cache.stop(signal.SIGKILL)
    try:
        status, out = generate(
            engine.url,
            {
                "input_ids": list(range(300, 320)),
                "sampling_params": sp(rid("lost"), on_cache_error="inline"),
            },
        )
        assert status == 200 and out["meta_info"]["r3"]["inline"] is True, out
    finally:
        restart_cache(cache, tmp_path_factory)
    rollout = rid("view")
    prompt = list(range(340, 364))
    status, first = generate(engine.url, {"input_ids": prompt, "sampling_params": sp(rollout, 4)})
    assert status == 200 and first["meta_info"]["r3"]["stored"], first
    assert httpx.post(f"{engine.url}/flush_cache", timeout=60).status_code == 200
    turn2 = [*prompt, *first["output_ids"], 7, 8]
    status, second = generate(engine.url, {"input_ids": turn2, "sampling_params": sp(rollout, 4)})
    assert status == 200 and second["meta_info"]["r3"]["views"], second
    prompts = [list(range(400 + 40 * i, 430 + 40 * i)) for i in range(3)]
    status, err = generate(
        engine.url,
        {
            "input_ids": prompts,
            "sampling_params": sp([rid() for _ in prompts], 16, on_retraction="fail"),
        },
    )
    assert status == 503 and "retracted" in err["error"]["message"], err
    return str(rollout)


def test_every_series_the_monitoring_reads_is_exported(
    glm_engine: EngineServer,
    engine_cache: Service,
    cache_client: RoutingClient,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    rollout = _run(glm_engine, engine_cache, tmp_path_factory)
    rows = cache_client.stat(rollout).num_rows
    assert [r for r, _ in cache_client.get_many([rollout, rid("absent")], return_errors=True)]
    found = check_step(cache_client, [rollout], [rows + 1], view="generated")
    assert found.off_state_tokens > 0  # the view's rows: the replay is off their state
    found = check_step(cache_client, [rollout], [rows + 1])  # exact: nothing off, expanded
    assert found.off_state_tokens == 0 and found.extra_samples > 0 and found.extra_tokens > 0
    gone = rid("gone")
    status, _ = generate(glm_engine.url, {"input_ids": [5, 6, 7], "sampling_params": sp(gone)})
    assert status == 200 and cache_client.delete(gone)

    service = httpx.get(
        f"{engine_cache.http_url}/metrics",
        headers={"Authorization": f"Bearer {METRICS_KEY}"},
        timeout=30,
    ).text
    engine = httpx.get(f"{glm_engine.url}/r3/metrics", timeout=30).text
    exported: dict[str, set[str]] = {}
    for text in (service, engine, registry_text(REGISTRY)):
        for name, labels in label_names(text).items():
            exported.setdefault(name, set()).update(labels)

    # The run produced what it is about, each counted where it happened.
    assert value(service, "r3_store_up") == 1
    assert (value(service, "r3_views_stored_total") or 0) >= 1
    assert (value(engine, "r3_engine_rows_lost_total") or 0) > 0
    assert (value(engine, "r3_engine_view_rows_total") or 0) > 0
    # Recorded series are Prometheus's, not an exporter's; the scrape's target labels
    # (namespace, pod, …) are left out by monitoring_selectors.
    recorded = {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}
    wanted = {n: ls for n, ls in monitoring_selectors().items() if n not in recorded}
    assert wanted and all(n.startswith("r3_") for n in wanted), sorted(wanted)
    missing = sorted(n for n in wanted if n not in exported)
    assert not missing, f"series the monitoring reads that no process exports: {missing}"
    unlabelled = {n: sorted(ls - exported[n]) for n, ls in wanted.items() if ls - exported[n]}
    assert not unlabelled, f"labels the monitoring uses that no sample carries: {unlabelled}"
