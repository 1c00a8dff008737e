"""The torch backend: Llama, Qwen2, Qwen3, Mistral and Qwen3-MoE models with continuous
batching over a paged KV cache.

Modules, one job each: ``options`` (what the backend is told), ``config`` (the decoder's
features), ``families`` (config.json to those features, one module per model family),
``weights`` (seeded or safetensors weights into the model), ``model`` (the network), ``mlp``
and ``experts`` (its MLP: dense, or a mixture of experts), ``kernels`` (its swappable
pieces: eager, or fused on CUDA), ``paged_attention`` (the Triton decode kernel), ``rope``, ``tokenizer`` (tokenizers and incremental
detokenisation), ``sequence``, ``block_manager`` (cache pages and the prefix cache, no torch),
``scheduler`` (batching, no torch), ``memory`` (cache sizing and allocation), ``batch`` (step
inputs), ``cuda_graphs`` (decode graphs per batch bucket), ``sampling``, ``request_state``
(stop rules), ``profiler``, ``setup`` (device, dtype and kernel choice), and the three parts a
step runs on, each the one owner of its state: ``request_table`` (the requests, the scheduler
and their lock), ``model_runner`` (the model, the KV cache and the graphs) and ``step_phases``
(the step in flight, over the other two); ``backend`` composes them (the glue).
"""
