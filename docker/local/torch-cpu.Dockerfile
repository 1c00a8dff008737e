# A CPU PyTorch base for the engine image's CPU variant (dpcoord/engine:local-cpu), the role
# pytorch/pytorch plays for the CUDA one: Python with torch installed system-wide, so the
# engine's `pip install ".[engine]"` finds torch in range and keeps it; NumPy too, as there.
# docker/local/bases.sh puts the CPU wheel in the build context (`pip download torch --no-deps`,
# which must resolve to a +cpu build: pip's find-links or https://download.pytorch.org/whl/cpu).
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY torch-*.whl /tmp/wheels/
RUN pip install --no-compile /tmp/wheels/torch-*.whl numpy \
 && rm -rf /tmp/wheels \
 && python -c "import sys, torch; print('torch', torch.__version__); sys.exit(torch.version.cuda is not None and 'not a CPU build')"
