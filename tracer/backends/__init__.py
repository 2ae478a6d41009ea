"""``moetrace.tracer.backends``: the engines that record which experts a model routes every token to.

- ``hf``: HF transformers on CPU or GPU, routing read from forward hooks on the model's own routers.
- ``vllm``: vLLM on GPU nodes, from vLLM's own routed-experts capture.
- ``vllm_convert``: vLLM's routed-experts arrays (every version's layout) → trace rows; pure numpy.

Each backend is imported lazily by ``moetrace.tracer.collect``; importing this package imports nothing heavy.
"""
