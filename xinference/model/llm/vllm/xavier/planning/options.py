"""Xavier's options for one replica, validated, and their trip through vLLM's config (pure).

Sources, later ones winning: defaults, launch environment variables
(``XAVIER_GPU_BUDGET``, ``XAVIER_CPU_BUDGET``), then the keys of Xinference's
``xavier_config`` (``xavier_gpu_budget``, ``xavier_cpu_budget``).  The options
reach vLLM's engine-core and worker processes inside
``KVTransferConfig.kv_connector_extra_config["xavier"]`` as a plain dict
(:meth:`XavierOptions.to_extra_config` / :meth:`XavierOptions.from_extra_config`).

Every error is a ``ValueError`` whose message starts with the option's name.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional

from .budget import parse_bytes
from .in_place import SAVE_POLICIES
from .routes import normalize_transport

DEFAULT_GPU_BUDGET = "1GiB"
DEFAULT_CPU_BUDGET = "1GiB"
ENV_GPU_BUDGET = "XAVIER_GPU_BUDGET"
ENV_CPU_BUDGET = "XAVIER_CPU_BUDGET"
ENV_BATCHED = "XAVIER_BATCHED_LOADS"
ENV_SWITCH_INTERVAL = "XAVIER_SWITCH_INTERVAL_US"
ENV_IN_PLACE = "XAVIER_IN_PLACE"
ENV_SAVE_VICTIMS = "XAVIER_SAVE_VICTIMS"
ENV_LOAD_POLICY = "XAVIER_LOAD_POLICY"
ENV_HOST_INDEX = "XAVIER_HOST_INDEX"
ENV_ROOM_COPY_PROGRAMS = "XAVIER_ROOM_COPY_PROGRAMS"
ENV_LOCAL_PUBLISH = "XAVIER_LOCAL_PUBLISH"
ENV_QUIET_MS = "XAVIER_QUIET_MS"
#: ``xavier_quiet_ms``: a worker's background directory calls and demotions wait until it
#: launched no load and no save for this long, at most 4x it (``mechanism/quiet_gate.py``)
DEFAULT_QUIET_MS = 30
#: thread blocks of the room thread's demotions into a CUDA engine's CPU tier (through its
#: CUDA view): a full-grid copy into page-locked memory made a decode step beside it 3.8x
#: slower, 4 blocks 1.2x at 85 % of the bandwidth (H100, benchmarks/room_interference.py)
ROOM_COPY_PROGRAMS = 4
#: ``xavier_load_policy``: ``cost`` loads a hit only when its measured wait is no longer than
#: the recompute it saves (:mod:`.load_cost`); ``always`` loads every hit (the model still
#: measures and counts the hits that do not pay)
LOAD_POLICIES = ("cost", "always")
#: ``xavier_save_victims``: which published blocks vLLM hands out again are saved into
#: Xavier's tiers (never one a same-host peer holds in its vLLM cache then): ``shared``
#: those shown to be shared (this replica loaded it, or a same-host peer held it once),
#: ``all`` every one, ``off`` none.  A switch's true means ``all``, false ``off``
#: (``SAVE_POLICIES``, imported from :mod:`.in_place`, whose book checks it)

#: the GIL switch interval (µs) of vLLM's engine processes with Xavier (Python's is 5000)
DEFAULT_SWITCH_INTERVAL_US = 500
#: every ``XAVIER_*`` environment variable a deployment may set (read by the package)
KNOWN_ENV = (ENV_GPU_BUDGET, ENV_CPU_BUDGET, ENV_BATCHED, ENV_SWITCH_INTERVAL, ENV_IN_PLACE,
             ENV_SAVE_VICTIMS, ENV_LOAD_POLICY, ENV_HOST_INDEX, "XAVIER_LOG_LEVEL",
             "XAVIER_COPY_KERNEL", "XAVIER_UVA", "XAVIER_TEST_HOOKS", "XAVIER_STEP_TRACE",
             ENV_ROOM_COPY_PROGRAMS, ENV_LOCAL_PUBLISH, ENV_QUIET_MS)
#: names of this project's own test and benchmark tooling (besides ``XAVIER_TEST_*``)
TOOLING_ENV = ("XAVIER_TINY_MODEL_DIR", "XAVIER_TINY_HYBRID_MODEL_DIR", "XAVIER_TINY_MLA_MODEL_DIR",
               "XAVIER_RELIABILITY_JSON", "XAVIER_BENCH_MODES",
               "XAVIER_BENCH_UNIQUE", "XAVIER_BENCH_ARGS", "XAVIER_CHAT_USERS", "XAVIER_CHAT_SHAPE",
               "XAVIER_CROSSOVER_PREFIXES", "XAVIER_CROSSOVER_POLICIES", "XAVIER_PROF_DEVICE",
               "XAVIER_E2E_FILES", "XAVIER_GPU_TEST_TIMEOUT", "XAVIER_EAGER_VLLM_VERSION")
EXTRA_KEY = "xavier"
#: Xinference's uid stem of a rank's transfer actor (``TransferActor.default_uid()``)
TRANSFER_ACTOR_UID = "vllm-transfer-actor"


def transfer_actor_uid(rank: int) -> str:
    """The uid Xinference gives rank ``rank``'s transfer actor (the one spelling of it)."""
    return f"{TRANSFER_ACTOR_UID}-{rank}"


@dataclass(frozen=True)
class XavierOptions:
    """One replica's Xavier settings, validated once (``from_xavier_config`` at launch,
    ``from_extra_config`` in vLLM's processes); travels as this dataclass."""

    rank: int
    rank_address: str
    block_tracker_address: str
    block_tracker_uid: str
    gpu_budget_bytes: int
    cpu_budget_bytes: int
    transport: str = "xavier"
    world_size: int = 0
    #: False: one load call per request instead of one per step (the baseline of the
    #: benchmarks; ``xavier_batched_loads`` / ``XAVIER_BATCHED_LOADS``)
    batched_loads: bool = True
    #: blocks per full slab (Xinference's ``xavier_transfer_block_num``, default 512)
    slab_blocks: int = 512
    #: ``sys.setswitchinterval`` of vLLM's engine processes, µs (``xavier_switch_interval_us``
    #: / ``XAVIER_SWITCH_INTERVAL_US``; 0 keeps Python's): Xavier's threads (demotions,
    #: publications, lookups) there must not hold the engine loop for Python's 5 ms
    switch_interval_us: int = DEFAULT_SWITCH_INTERVAL_US
    #: share straight from vLLM's own KV cache (``xavier_in_place`` / ``XAVIER_IN_PLACE``,
    #: default true): a computed block is published in place, no copy; Xavier's tiers hold
    #: only the published blocks vLLM hands out again.  False: every computed block is
    #: copied into Xavier's tiers (the design before 2026-12; a benchmark row)
    in_place: bool = True
    #: with ``in_place``: which published blocks vLLM hands out again are saved into
    #: Xavier's tiers before they are overwritten (``xavier_save_victims`` /
    #: ``XAVIER_SAVE_VICTIMS``: :data:`SAVE_POLICIES`, default ``shared``; ``off`` leaves
    #: Xavier's tiers empty).  A save costs the step that hands the block out (session 31,
    #: H100: a C1 hit's TTFT 40 ms with every victim saved, 27 ms with none)
    save_victims: str = "shared"
    #: whether a hit is loaded whatever it costs (``xavier_load_policy`` /
    #: ``XAVIER_LOAD_POLICY``: :data:`LOAD_POLICIES`, default ``cost``)
    load_policy: str = "cost"
    #: with ``in_place``: same-host peers find this replica's published blocks in a file of
    #: ``/dev/shm`` without a directory round trip (``xavier_host_index`` /
    #: ``XAVIER_HOST_INDEX``, default true; :mod:`~..mechanism.host_index`)
    host_index: bool = True
    #: with ``host_index``: while every replica of the launch is on this host, the blocks
    #: published in place go into the host indexes only, with no directory call
    #: (``xavier_local_publish`` / ``XAVIER_LOCAL_PUBLISH``, default true;
    #: :mod:`~..mechanism.publisher`)
    local_publish: bool = True
    #: a worker's background directory calls and demotions wait until it launched no load
    #: and no save for this long (``xavier_quiet_ms`` / ``XAVIER_QUIET_MS``, default
    #: :data:`DEFAULT_QUIET_MS`; 0: they run at once): not inside a hit's wait
    quiet_ms: int = DEFAULT_QUIET_MS

    @property
    def transfer_actor_uid(self) -> str:
        """uid Xinference gives the rank's transfer actor (``TransferActor.default_uid()``)."""
        return transfer_actor_uid(self.rank)

    @classmethod
    def from_xavier_config(cls, xavier_config: Mapping[str, Any],
                           environ: Optional[Mapping[str, str]] = None) -> XavierOptions:
        """From Xinference's ``xavier_config`` (see the 3.5.0 contract) and the environment."""
        env = environ or {}
        check_env_names(env)
        cfg = dict(xavier_config or {})
        for key in ("rank", "rank_address", "block_tracker_address", "block_tracker_uid"):
            if cfg.get(key) in (None, ""):
                raise ValueError(f"xavier_config: missing {key!r}")
        rank = cfg["rank"]
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"xavier_config: rank must be a non-negative int, got {rank!r}")
        uid = cfg["block_tracker_uid"]
        if isinstance(uid, bytes):
            uid = uid.decode()
        gpu = cfg.get("xavier_gpu_budget", env.get(ENV_GPU_BUDGET, DEFAULT_GPU_BUDGET))
        cpu = cfg.get("xavier_cpu_budget", env.get(ENV_CPU_BUDGET, DEFAULT_CPU_BUDGET))
        gpu_bytes = parse_bytes("xavier_gpu_budget", gpu)
        cpu_bytes = parse_bytes("xavier_cpu_budget", cpu)
        if gpu_bytes == 0 and cpu_bytes == 0:
            raise ValueError("xavier_gpu_budget: both storage tiers are 0 bytes: nothing could "
                             "be shared (set xavier_gpu_budget or xavier_cpu_budget)")
        transport = normalize_transport(cfg.get("vllm_transfer_backend_type"))
        batched = parse_switch("xavier_batched_loads",
                              cfg.get("xavier_batched_loads", env.get(ENV_BATCHED, True)))
        switch_us = parse_switch_interval(cfg.get(
            "xavier_switch_interval_us", env.get(ENV_SWITCH_INTERVAL, DEFAULT_SWITCH_INTERVAL_US)))
        in_place = parse_switch("xavier_in_place",
                                cfg.get("xavier_in_place", env.get(ENV_IN_PLACE, True)))
        save_victims = parse_save_victims(cfg.get("xavier_save_victims",
                                                  env.get(ENV_SAVE_VICTIMS, "shared")))
        load_policy = parse_load_policy(cfg.get("xavier_load_policy",
                                                env.get(ENV_LOAD_POLICY, "cost")))
        host_index = parse_switch("xavier_host_index", cfg.get(
            "xavier_host_index", env.get(ENV_HOST_INDEX, True)))
        local_publish = parse_switch("xavier_local_publish", cfg.get(
            "xavier_local_publish", env.get(ENV_LOCAL_PUBLISH, True)))
        quiet_ms = parse_quiet_ms(cfg.get("xavier_quiet_ms", env.get(ENV_QUIET_MS,
                                                                     DEFAULT_QUIET_MS)))
        slab = cfg.get("transfer_block_num", 512)
        if isinstance(slab, bool) or not isinstance(slab, int) or slab < 1:
            raise ValueError(f"xavier_transfer_block_num: must be a positive int, got {slab!r}")
        return cls(rank=rank, rank_address=str(cfg["rank_address"]),
                   block_tracker_address=str(cfg["block_tracker_address"]),
                   block_tracker_uid=str(uid), gpu_budget_bytes=gpu_bytes,
                   cpu_budget_bytes=cpu_bytes, transport=transport,
                   switch_interval_us=switch_us,
                   world_size=int(cfg.get("world_size") or 0), batched_loads=batched,
                   slab_blocks=slab, in_place=in_place,
                   save_victims=save_victims, load_policy=load_policy,
                   host_index=host_index, local_publish=local_publish, quiet_ms=quiet_ms)

    def to_extra_config(self) -> Dict[str, Any]:
        return {EXTRA_KEY: asdict(self)}

    @classmethod
    def from_extra_config(cls, extra: Optional[Mapping[str, Any]]) -> XavierOptions:
        data = (extra or {}).get(EXTRA_KEY)
        if not isinstance(data, Mapping):
            raise ValueError(f"kv_connector_extra_config: missing the {EXTRA_KEY!r} entry "
                             "(build the engine with XavierEngine.from_engine_args)")
        try:
            return cls(**dict(data))
        except TypeError as exc:
            raise ValueError(f"kv_connector_extra_config.{EXTRA_KEY}: {exc}") from None


def _whole_number(value: Any) -> int:
    """``value`` as an int (a bool or anything else that is not a whole number: -1)."""
    try:
        return -1 if isinstance(value, bool) else int(str(value).strip())
    except ValueError:
        return -1


def parse_quiet_ms(value: Any) -> int:
    """``xavier_quiet_ms`` as whole milliseconds from 0 (off) to 1000; anything else raises
    ``ValueError`` naming the option."""
    ms = _whole_number(value)
    if not 0 <= ms <= 1000:
        raise ValueError(f"xavier_quiet_ms: expected whole milliseconds from 0 (off) to 1000, "
                         f"got {value!r}")
    return ms


def parse_switch_interval(value: Any) -> int:
    """``xavier_switch_interval_us`` as an int from 0 (keep Python's) to 1000000 µs; anything
    else raises ``ValueError`` naming the option."""
    us = _whole_number(value)
    if not 0 <= us <= 1_000_000:
        raise ValueError("xavier_switch_interval_us: expected whole microseconds from 0 "
                         f"(Python's default) to 1000000, got {value!r}")
    return us


def parse_load_policy(value: Any) -> str:
    """``xavier_load_policy`` as one of :data:`LOAD_POLICIES` (any case); anything else
    raises ``ValueError`` naming the option."""
    text = str(value).strip().lower()
    if text not in LOAD_POLICIES:
        raise ValueError(f"xavier_load_policy: expected one of {', '.join(LOAD_POLICIES)}, "
                         f"got {value!r}")
    return text


def parse_save_victims(value: Any) -> str:
    """``xavier_save_victims`` as one of :data:`SAVE_POLICIES` (any case; a switch's true
    is ``all``, false ``off``); anything else raises ``ValueError`` naming the option."""
    text = str(value).strip().lower()
    if text in SAVE_POLICIES:
        return text
    try:
        return "all" if parse_switch("xavier_save_victims", value) else "off"
    except ValueError:
        raise ValueError(f"xavier_save_victims: expected one of {', '.join(SAVE_POLICIES)} "
                         f"(or true = all, false = off), got {value!r}") from None


def room_copy_programs(environ: Mapping[str, str]) -> Optional[int]:
    """The room thread's demotion thread blocks: :data:`ROOM_COPY_PROGRAMS`, or
    ``XAVIER_ROOM_COPY_PROGRAMS`` (a diagnostic: another count; ``0`` the full grid, as
    before session 37, returned as None); anything else raises ``ValueError`` naming it."""
    value = str(environ.get(ENV_ROOM_COPY_PROGRAMS, "")).strip()
    if not value:
        return ROOM_COPY_PROGRAMS
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"{ENV_ROOM_COPY_PROGRAMS}: expected a whole number >= 0 (0: the "
                         f"full grid), got {value!r}")
    return int(value) or None


def parse_switch(option: str, value: Any) -> bool:
    """``True``/``False`` from a bool or true/false/1/0/yes/no/on/off (any case); anything
    else raises ``ValueError`` naming ``option``."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{option}: expected true or false, got {value!r}")


def check_env_names(environ: Mapping[str, str]) -> None:
    """A misspelled ``XAVIER_*`` variable fails, naming the closest known one: otherwise its
    default would silently apply (e.g. the whole GPU budget for ``XAVIER_GPU_BUGDET``)."""
    for name in sorted(environ):
        if (not name.startswith("XAVIER_") or name in KNOWN_ENV or name in TOOLING_ENV
                or name.startswith("XAVIER_TEST_")):
            continue
        close = difflib.get_close_matches(name, KNOWN_ENV, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(KNOWN_ENV)}"
        raise ValueError(f"{name}: unknown Xavier setting; {hint}")
