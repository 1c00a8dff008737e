# The gateway image: slim Python, the OpenAI-compatible HTTP gateway, no torch, non-root.
# Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t dpcoord/gateway:0.1.0 .
# It installs the dpcoord package with the `gateway` extra only (Starlette, uvicorn, httptools,
# uvloop); tests/test_images.py holds it to that.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY handlers ./handlers
COPY engines ./engines
RUN python -m venv /opt/dpcoord \
 && /opt/dpcoord/bin/pip install --no-compile ".[gateway,otel]"

FROM python:3.11-slim
COPY --from=build /opt/dpcoord /opt/dpcoord
ENV PATH=/opt/dpcoord/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin dpcoord
USER 10001:10001
# The OpenAI API, /healthz, /readyz and /metrics (settings.gateway_port).
EXPOSE 8000
ENTRYPOINT ["dpcoord"]
CMD ["gateway"]
