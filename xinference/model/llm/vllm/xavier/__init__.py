"""Xavier for vLLM V1: cross-replica prefix KV sharing for Xinference 3.5.0.

This package is served as ``xinference.model.llm.vllm.xavier`` by the import
overlay of this project (``_xinference_xavier_overlay``); upstream's V0-only
package of the same name stays installed and untouched.

Layers (see ``doc/architecture.md``):

* planning, pure (numpy only): :mod:`.load_batch`, :mod:`.plan`;
* mechanism (torch): :mod:`.kv_schema`, :mod:`.slabs`, :mod:`.block_copy`,
  :mod:`.gpu_transfer`, :mod:`.counters`;
* adapters (xoscar / Xinference hook classes): :mod:`.transport`,
  :mod:`.block_tracker`, :mod:`.collective_manager`.

The package itself imports nothing heavy: Xinference's supervisor imports
:mod:`.block_tracker`, :mod:`.collective_manager` and :mod:`.transport` at
start, and those must load with xoscar alone (no torch, no vLLM).
"""

__version__ = "0.1.0"
#: marks this package as the fork's, for checks and diagnostics
XAVIER_FORK = True
