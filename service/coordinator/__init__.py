"""Layer 4, the coordinator role, split by job (docs/architecture.md). It serves the handlers
it is given and never imports the ``handlers`` package's registrations itself."""
