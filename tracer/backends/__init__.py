"""``moetrace.tracer.backends``: the engines that record which experts a model routes every token to.

- ``base``: the one protocol every backend has (``CollectionBackend``: check the environment, load,
  describe itself for the manifest, run the engine loop on one ``GenerationConfig``).
- ``registry``: the one table of backends (``BACKENDS``: name, how to build it, when ``auto`` picks
  it, the GPUs one engine takes) and ``choose_backend``.
- ``hf``: HF transformers on CPU or GPU, routing read from forward hooks on the model's own routers.
- ``vllm``: vLLM on GPU nodes, from vLLM's own routed-experts capture.
- ``vllm_convert``: vLLM's routed-experts arrays (every version's layout) → trace rows; pure numpy.

A new backend is one module here and one row in ``registry``. A backend module is imported when
its registry row builds it; importing this package, ``base`` or ``registry`` imports nothing heavy.
"""
