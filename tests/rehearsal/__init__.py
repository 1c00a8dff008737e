"""The deployment rehearsal (``pytest -m rehearsal``): the Helm chart's pods run as processes.

No images are built here (there is no Docker engine on this machine) and no Kubernetes runs.
Instead each image's Python environment is installed as its Dockerfile installs it, from only
the files its build context lets through (image_env.py), and each pod the chart renders
(deployment.py) is started as a process of that environment with its container's command,
args, environment and mounted Secrets (pods.py), on a nats-server configured as the chart
configures NATS (nats.py). Every departure from the real thing is in overrides.py.

Not rehearsed: the image build itself (base images, layers, the non-root user), the pods'
security context (runAsUser, a read-only root filesystem), resources and GPUs, Services and
DNS, TLS to NATS, the nats sub-chart's own templates (not fetched: no network).
"""
