"""The OpenAI-compatible HTTP gateway (``dpcoord gateway``): a role beside the coordinator, the
client library, the handlers and the engines.

It turns ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` into submissions and
model listings through :mod:`service.client`, and imports nothing else of dpcoord but layers 1-3
(protocol, bus, ops). Its third-party needs (Starlette, uvicorn, httptools) are the ``gateway``
extra, so the coordinator image goes without them.
"""
