# sglang-router in front of the SGLang fleet; its version is the `fleet` extra's pin
# (pyproject.toml), the release sglang_r3/launch/fleet.py's settings were measured against.
# Build from the repository root:
#   docker build -f deploy/docker/router.Dockerfile -t ghcr.io/sglang-r3/router:0.1.0-router0.3.2 .

FROM python:3.11.14-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml README.md ./
COPY clients ./clients
COPY cache_service ./cache_service
COPY sglang_r3 ./sglang_r3
RUN /opt/venv/bin/pip install --no-cache-dir ".[fleet]"

FROM python:3.11.14-slim-bookworm
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin r3
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 30000 29000
ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]
