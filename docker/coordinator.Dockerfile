# The coordinator image: slim Python, no torch, non-root.
# Build from the repository root:
#   docker build -f docker/coordinator.Dockerfile -t dpcoord/coordinator:0.1.0 .
# It installs the dpcoord package without the `engine` extra, so torch is never pulled in
# (tests/rehearsal/test_images.py installs it as this file does and holds it to that).

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY handlers ./handlers
COPY engines ./engines
RUN python -m venv /opt/dpcoord \
 && /opt/dpcoord/bin/pip install --no-compile ".[fast,otel]"

FROM python:3.11-slim
COPY --from=build /opt/dpcoord /opt/dpcoord
ENV PATH=/opt/dpcoord/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin dpcoord
USER 10001:10001
# /healthz, /readyz and /metrics (settings.http_port).
EXPOSE 8080
ENTRYPOINT ["dpcoord"]
CMD ["coordinator"]
