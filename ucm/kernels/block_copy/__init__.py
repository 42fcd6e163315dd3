"""Block copy: KV blocks between vLLM's paged caches and UCM's canonical blocks (``gather_blocks``,
``scatter_blocks``, ``gather_layers``, ``scatter_layers``, and ``warm_up``), exported by ``ucm.kernels``: the
package's public face, what the connector calls.

Modules, as in flash-linear-attention's ``fla/ops/<op>/``: ``ops`` (the public ops: validation and dispatch by
``impl``), ``naive`` (the references, the test oracles), ``triton`` (the Triton kernel), ``cpu`` (the CPU fast path)
and ``cpu_numba`` (its numba kernels, imported on first use), ``torch`` (strided torch copies).
"""
