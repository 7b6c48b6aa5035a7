# The routing cache service (`r3 serve`): HTTP :8080, gRPC :50051, Redis from R3_CACHE_REDIS_URL.
# Build from the repository root:
#   docker build -f deploy/docker/cache-service.Dockerfile -t ghcr.io/sglang-r3/cache-service:0.1.0 .

FROM python:3.11.14-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml README.md ./
COPY clients ./clients
COPY cache_service ./cache_service
COPY sglang_r3 ./sglang_r3
# The project's own pins (pyproject.toml) decide every version installed here.
RUN /opt/venv/bin/pip install --no-cache-dir ".[service]"

FROM python:3.11.14-slim-bookworm
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin r3
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8080 50051
ENTRYPOINT ["r3"]
CMD ["serve", "--host", "0.0.0.0"]
