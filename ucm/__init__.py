"""UCM: Unified Cache Management, an external, persistent, tiered KV cache for vLLM.

Layout (see README.md):
- ``ucm.config``: the UCM YAML schema (strict, typed).
- ``ucm.hashing``: block keys (request tokens -> chained 16-byte keys).
- ``ucm.store``: the store contract, the stores (``Cache``, ``Posix``) and the pipeline builder.
- ``ucm.kernels``: paged KV <-> canonical block gather/scatter.
- ``ucm.integration.vllm``: ``UCMConnector``, the only place that imports vLLM.
"""

__version__ = "0.1.0"
