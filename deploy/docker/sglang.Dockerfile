# SGLang 0.5.23 with the sglang-r3 extension: `python -m sglang_r3.launch_server ...`.
# One image for GPU pods and for the dev overlay's CPU mode (stub libcuda built here).
# Build from the repository root:
#   docker build -f deploy/docker/sglang.Dockerfile -t ghcr.io/sglang-r3/sglang:0.1.0-sglang0.5.23 .

FROM ghcr.io/astral-sh/uv:0.9.5 AS uv

# The devel image in both stages: FlashInfer and Triton compile kernels at run time and
# need nvcc and the CUDA headers there too. The build stage adds uv and the pip caches.
FROM nvidia/cuda:12.9.1-cudnn-devel-ubuntu22.04 AS build
COPY --from=uv /uv /usr/local/bin/uv
# Python 3.11 from uv's standalone builds (Ubuntu 22.04 ships 3.10), at a fixed path so
# the virtualenv can be copied into the runtime stage as is.
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_NO_CACHE=1
RUN uv python install 3.11.14 && uv venv --python 3.11.14 /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY clients ./clients
COPY cache_service ./cache_service
COPY sglang_r3 ./sglang_r3
# sglang==0.5.23 is pinned by the `sglang` extra; it pins torch 2.14.1 (CUDA build).
# Then the stub libcuda.so.1 for `--device cpu`, compiled now so CPU pods need no
# compiler and keep a read-only root filesystem (found via SGLANG_R3_CACHE_DIR).
RUN VIRTUAL_ENV=/opt/venv uv pip install ".[sglang,torch]" \
 && /opt/venv/bin/python -c "from pathlib import Path; from sglang_r3.cpu import build_cuda_stub; print(build_cuda_stub(Path('/opt/sglang-r3')))"

FROM nvidia/cuda:12.9.1-cudnn-devel-ubuntu22.04
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/r3 --shell /usr/sbin/nologin r3
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/sglang-r3 /opt/sglang-r3
ENV PATH=/opt/venv/bin:$PATH \
    SGLANG_R3_CACHE_DIR=/opt/sglang-r3 \
    HOME=/home/r3 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/r3
EXPOSE 30000
ENTRYPOINT ["python", "-m", "sglang_r3.launch_server"]
