"""dpcoord: a data-parallel LLM inference coordinator on the NATS message bus.

The coordinator never imports torch: engines do (see ``engines/``).
"""

PROTOCOL_VERSION = 1
