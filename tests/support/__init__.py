"""Helpers shared by the tests and benchmarks: frames, a cache service in a subprocess, SGLang
requests and fixtures, manifests, tiny models (import as ``tests.support.<module>``)."""
