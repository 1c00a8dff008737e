# The engine image: the dpcoord engine runtime on a CUDA build of PyTorch, non-root.
# Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t dpcoord/engine:0.1.0 .
# The base image already holds a CUDA torch inside the `engine` extra's range, so pip keeps
# it rather than fetching another; BASE_IMAGE picks a different CUDA or PyTorch version.

ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/dpcoord/src
COPY pyproject.toml README.md ./
COPY service ./service
COPY handlers ./handlers
COPY engines ./engines
RUN python -c "import torch, sys; print('torch', torch.__version__, 'CUDA', torch.version.cuda); sys.exit(torch.version.cuda is None)" \
 && pip install --no-compile ".[engine]" \
 && python -c "import torch; assert torch.version.cuda, 'the engine extra replaced the CUDA torch'"
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin dpcoord
USER 10001:10001
WORKDIR /home/dpcoord
# /healthz, /readyz and /metrics (settings.http_port).
EXPOSE 8080
ENTRYPOINT ["dpcoord"]
CMD ["engine"]
