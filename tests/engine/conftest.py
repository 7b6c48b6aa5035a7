"""Fixtures for the engine tests (defined in ``tests.support.engine_fixtures``, shared with the
adversarial suite): tiny MoE checkpoints, a cache service, real SGLang servers."""

from tests.support.engine_fixtures import (  # noqa: F401  (fixtures, found by pytest by name)
    cache_client,
    engine_cache,
    glm_engine,
    qwen_engine,
    release_glm_engine,
    release_qwen_engine,
    sglang_release,
    tiny_models,
)
