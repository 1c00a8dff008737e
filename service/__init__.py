"""dpcoord: a data-parallel LLM inference coordinator on the NATS message bus.

The packages below depend one way (docs/architecture.md; import-linter enforces it):
``protocol`` < ``bus`` < ``ops`` < the roles (``coordinator``, ``client``, and the top-level
``handlers`` and ``engines``) < ``cli``. The coordinator never imports torch: engines do.
"""
