"""The torch backend: Llama-family models with continuous batching over a paged KV cache.

Modules, one job each: ``config`` (architecture from config.json), ``weights`` (seeded or
safetensors weights into the model), ``model`` (the network), ``rope``, ``tokenizer``
(tokenizers and incremental detokenisation), ``scheduler`` (batching and cache pages, no
torch), ``memory`` (cache sizing), ``batch`` (step inputs), ``sampling``, ``backend`` (the glue).
"""
