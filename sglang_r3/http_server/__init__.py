"""What runs in SGLang's HTTP process (the tokenizer manager and its uvicorn app):
the generate and send hooks, request tags, the shipper that stores each finished output's
rows, the views of recomputed rows, the HTTP entry-point hooks, ``/r3/*`` metrics and
the loop probe, and the app SGLang's tokenizer workers import."""
