"""Xavier for vLLM V1: cross-replica prefix KV sharing for Xinference 3.5.0.

This package is served as ``xinference.model.llm.vllm.xavier`` by the import
overlay of this project (``_xinference_xavier_overlay``); upstream's V0-only
package of the same name stays installed and untouched.

Layers, one folder each, imports only downwards (see ``doc/architecture.md``):

* :mod:`.planning` -- pure (numpy and the standard library): load batches and plans,
  the block directory, leases, the scheduler side, options, counters;
* :mod:`.mechanism` -- torch: KV layouts, storage tiers, copies, the load engine, NIXL;
* :mod:`.vllm_side` -- vLLM's connector halves, the worker's data plane, peers;
* this folder -- the modules Xinference 3.5.0 imports by path: :mod:`.engine`,
  :mod:`.transfer`, :mod:`.block_tracker`, :mod:`.collective_manager`, :mod:`.transport`;
  and :mod:`.replica_routing`, which the overlay installs into Xinference's API.

Module by module: the one file map in ``doc/architecture.md``.

The package itself imports nothing heavy: Xinference's supervisor imports
:mod:`.block_tracker`, :mod:`.collective_manager` and :mod:`.transport` at
start, and those must load with xoscar alone (no torch, no vLLM).
"""

__version__ = "0.1.0"
#: marks this package as the fork's, for checks and diagnostics
XAVIER_FORK = True
