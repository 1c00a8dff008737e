# The engine image: the dpcoord engine runtime on a build of PyTorch, non-root.
# Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t dpcoord/engine:0.1.0 .
# The base image already holds a torch inside the `engine` extra's range, so pip keeps it rather
# than fetching another; BASE_IMAGE picks a different CUDA or PyTorch version.
# The CPU variant (CI, CPU clusters) shares this file: a base with CPU torch and REQUIRE_CUDA=0,
#   docker build -f docker/engine.Dockerfile --build-arg BASE_IMAGE=dpcoord/torch-cpu:2.13.0 \
#     --build-arg REQUIRE_CUDA=0 -t dpcoord/engine:local-cpu .
# (`make images` does; docker/local/bases.sh makes that base.) Either way the build fails if the
# base's torch is not the kind asked for, or if installing the engine extra swapped it.

ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}
# 1: the base's torch must be a CUDA build; 0: a CPU build.
ARG REQUIRE_CUDA=1
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/dpcoord/src
COPY pyproject.toml README.md ./
COPY service ./service
COPY handlers ./handlers
COPY engines ./engines
RUN python -c "import os, sys, torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda); sys.exit((torch.version.cuda is not None) != (os.environ['REQUIRE_CUDA'] == '1') and 'the base image torch is not the build REQUIRE_CUDA asks for')" \
 && pip install --no-compile ".[engine,fast,otel]" \
 && python -c "import os, sys, torch; sys.exit((torch.version.cuda is not None) != (os.environ['REQUIRE_CUDA'] == '1') and 'the engine extra replaced the base image torch')"
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin dpcoord
USER 10001:10001
WORKDIR /home/dpcoord
# /healthz, /readyz and /metrics (settings.http_port).
EXPOSE 8080
ENTRYPOINT ["dpcoord"]
CMD ["engine"]
