"""The deployment rehearsal (``pytest -m rehearsal``): the Helm chart's pods run as containers of
the built images, or, without Docker, as processes.

No Kubernetes runs. Each pod the chart renders (deployment.py) is started with its container's
command, args, environment and volumes: where a Docker engine holds the images of ``make images``,
as a container of its image with the pod's user and group, read-only root, dropped capabilities,
emptyDirs as tmpfs and Secrets and ConfigMaps as files (containers.py); elsewhere as a process of
an environment installed as its Dockerfile installs it, from only the files its build context
lets through (image_env.py, pods.py). Either way it talks to nats-server processes configured as
the chart configures NATS (nats.py). Every departure from the real thing is in overrides.py.

Not rehearsed: resources and GPUs, Services and DNS (the pods share the host's loopback), TLS to
NATS, the nats sub-chart's own templates (not fetched: no network). Without Docker, also the
image build itself and the pods' security context.
"""
