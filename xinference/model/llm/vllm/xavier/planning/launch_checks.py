"""Xavier's launch options, checked in the supervisor before any engine starts (pure).

Xinference 3.5.0's supervisor reads ``enable_xavier`` with ``bool()`` (so ``"false"`` turns
Xavier on) and passes unknown keys, such as the CLI spelling ``enable-xavier``, to vLLM,
which fails only after the engines started.  The overlay wraps the supervisor's
``launch_builtin_model`` to run :func:`normalize_launch` on its keyword arguments first:
Xavier's own keys in either spelling, ``enable_xavier`` as a strict switch, and, when it is
on, the replica count, vLLM's pipeline and data parallel sizes (1 only: tensor parallelism
is shared shard by shard, pipeline stages and data-parallel engines are not), vLLM's prefix
hash (a cryptographic one: block names cross replicas), ``xavier_routing`` (how the API
picks a replica: ``cache_aware`` by default, ``round_robin``; the overlay keeps it in the
supervisor, the model never sees it) and the ``XAVIER_*`` launch envs, each failing at
once with a message that starts with the option's name.  Nothing else of the launch is
touched.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping, MutableMapping, Optional

from .budget import parse_bytes
from .options import (
    ENV_BATCHED,
    ENV_CPU_BUDGET,
    ENV_GPU_BUDGET,
    ENV_HOST_INDEX,
    ENV_IN_PLACE,
    ENV_LOAD_POLICY,
    ENV_LOCAL_PUBLISH,
    ENV_QUIET_MS,
    ENV_SAVE_VICTIMS,
    ENV_SWITCH_INTERVAL,
    check_env_names,
    parse_load_policy,
    parse_quiet_ms,
    parse_save_victims,
    parse_switch,
    parse_switch_interval,
    room_copy_programs,
)
from .routing import parse_routing

#: Xavier's own launch keys: the dashed spelling (the CLI's ``--enable-xavier``) is accepted
XAVIER_KEYS = ("enable_xavier", "vllm_transfer_backend_type", "transfer_backend_type",
               "xavier_transfer_block_num", "xavier_routing")


#: vLLM's prefix-caching hashes Xavier accepts: block names are shared between replicas
#: (and tenants), so a crafted collision must be infeasible (``doc/security.md``)
COLLISION_RESISTANT_HASHES = ("sha256", "sha256_cbor")


def prefix_hash_problem(algo: Any) -> Optional[str]:
    """Why vLLM's ``prefix_caching_hash_algo`` ``algo`` cannot name shared blocks, or None
    (None too when unset: vLLM's default is sha256)."""
    if algo is None or str(algo) in COLLISION_RESISTANT_HASHES:
        return None
    return (f"prefix_caching_hash_algo: Xavier shares blocks between replicas by vLLM's "
            f"prefix hashes, which must be collision resistant "
            f"({' or '.join(COLLISION_RESISTANT_HASHES)}), got {str(algo)!r}")


#: vLLM's parallelism options Xavier cannot share, and what they make of a replica
#: (``tensor_parallel_size`` is shared: each TP worker stores and loads its own shard of the
#: KV heads, :mod:`.shards`; a data-parallel replica runs several engines, each with its own
#: scheduler and KV cache, where Xavier knows one engine per replica rank)
UNSHARED_PARALLEL_KEYS = {"pipeline_parallel_size": "pipeline-parallel",
                          "data_parallel_size": "data-parallel"}


def normalize_launch(kwargs: MutableMapping[str, Any], replica: Any,
                     envs: Optional[Dict[str, str]]) -> None:
    """Rewrite Xavier's keys of a launch's extra keyword arguments in place; raise
    ``ValueError`` naming the option for a value that would fail later or silently."""
    for key in XAVIER_KEYS:
        dashed = key.replace("_", "-")
        if dashed in kwargs:
            if key in kwargs:
                raise ValueError(f"{key}: given twice (as {key} and {dashed})")
            kwargs[key] = kwargs.pop(dashed)
    on = "enable_xavier" in kwargs and parse_switch("enable_xavier", kwargs["enable_xavier"])
    if "enable_xavier" in kwargs:
        kwargs["enable_xavier"] = on
    if not on:
        if "xavier_routing" in kwargs:
            raise ValueError(f"xavier_routing: routes the replicas of a Xavier launch; "
                             f"launch with enable_xavier true or without xavier_routing, "
                             f"got xavier_routing={kwargs['xavier_routing']!r}")
        return
    try:
        replicas = int(replica)
    except (TypeError, ValueError):
        replicas = 0
    if replicas < 2:
        raise ValueError(f"enable_xavier: shares prefixes between replicas and needs "
                         f"replica >= 2, got replica={replica!r}")
    for key, kind in UNSHARED_PARALLEL_KEYS.items():
        value = kwargs.get(key, kwargs.get(key.replace("_", "-")))
        try:
            degree = int(value) if value is not None else 1
        except (TypeError, ValueError):
            degree = 1  # not Xavier's option: vLLM checks it
        if degree > 1:
            raise ValueError(f"{key}: Xavier does not share the KV of {kind} "
                             f"replicas (tensor parallelism is supported), got {key}="
                             f"{value!r}; launch with {key}=1 or without enable_xavier")
    kwargs["xavier_routing"] = parse_routing(kwargs.get("xavier_routing", "cache_aware"))
    problem = prefix_hash_problem(kwargs.get("prefix_caching_hash_algo",
                                             kwargs.get("prefix-caching-hash-algo")))
    if problem is not None:
        raise ValueError(f"{problem}; launch without it or with sha256")
    env = dict(envs or {})
    check_env_names(env)
    for name, option in ((ENV_GPU_BUDGET, "xavier_gpu_budget"),
                         (ENV_CPU_BUDGET, "xavier_cpu_budget")):
        if name in env:
            parse_bytes(option, env[name])
    if ENV_SWITCH_INTERVAL in env:
        parse_switch_interval(env[ENV_SWITCH_INTERVAL])
    if ENV_LOAD_POLICY in env:
        parse_load_policy(env[ENV_LOAD_POLICY])
    if ENV_SAVE_VICTIMS in env:
        parse_save_victims(env[ENV_SAVE_VICTIMS])
    if ENV_QUIET_MS in env:
        parse_quiet_ms(env[ENV_QUIET_MS])
    room_copy_programs(env)
    for name, option in ((ENV_IN_PLACE, "xavier_in_place"), (ENV_BATCHED, "xavier_batched_loads"),
                         (ENV_HOST_INDEX, "xavier_host_index"),
                         (ENV_LOCAL_PUBLISH, "xavier_local_publish")):
        if name in env:
            parse_switch(option, env[name])


def asks_for_xavier(kwargs: Mapping[str, Any]) -> bool:
    """Whether a launch's extra keyword arguments turn Xavier on (either spelling; a value
    that is not a switch counts as off here: the supervisor refuses it, naming it)."""
    for key in ("enable_xavier", "enable-xavier"):
        if key in kwargs:
            try:
                return parse_switch("enable_xavier", kwargs[key])
            except ValueError:
                return False
    return False


def error_text(message: str) -> str:
    """A launch error's own text, starting with the option's name: without the client's
    ``Failed to launch model, detail:``, vLLM's two ``collective_rpc`` wrapper forms and
    xoscar's ``[address=..., pid=...]`` prefixes."""
    m = re.search(r"Worker failed with error '(.*)'", message, re.S)
    text = m.group(1) if m else message
    text = re.sub(r"^Failed to launch model, detail:\s*", "", text.strip())
    text = re.sub(r"^(\[address=[^\]]*\]\s*)+", "", text)
    text = re.sub(r"^Call to collective_rpc method failed:\s*", "", text)
    return re.sub(r"^(\[address=[^\]]*\]\s*)+", "", text)
