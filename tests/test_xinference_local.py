"""Real ``xinference-local`` (3.5.0) on loopback, Xavier switched on over REST exactly as a
user does (``"enable_xavier": true`` beside ``"replica": 2``, options as launch ``envs``):
the launch goes through upstream's supervisor, worker and model actor into this fork's hook
classes and two real vLLM CPU engines; requests are routed by cache and load (a follow-up to
the replica that computed its prefix, a burst spilled to the other, which loads the prefix
from its peer), or round robin when launched so (a prefix computed by one replica is loaded
by the other); termination leaves no engine process and no model; a bad option fails the
launch with a message naming it.

Two settings differ from a GPU launch, both plain launch parameters: ``tensor_parallel_size``
(Xinference defaults it to the number of GPUs, 0 here) and ``enable_virtual_env: false``
(the per-model virtualenv would install GPU wheels from the registry; the overlay inside
such a virtualenv is tested in ``test_overlay_child_venv.py``).

On the GPU machine (``XAVIER_TEST_DEVICE=cuda``, ``scripts/gpu-xinference-local.sh``) the
same test launches vLLM on CUDA: ``gpu_idx`` from ``XAVIER_TEST_GPUS`` (``0,0``: both replicas
on one GPU; ``0,1``: one each; Xinference gives replica ``i`` the ``i``-th), Triton attention
(the vLLM bundle has no flash-attention), a GPU tier of 256 MiB per replica.
"""

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures as concurrent_futures

import pytest

from xinference.model.llm.vllm.xavier import replica_routing

from .support.processes import alive, engine_cores
from .support.xinference_server import (
    DEVICE,
    MODEL,
    cli_launch,
    launch_body,
    metrics_endpoint,
    model_process,
    replica_statuses,
    routed,
    scrape,
    wait_for_series,
    xavier_envs,
)

pytestmark = pytest.mark.slow


def rank_addresses(server):
    """Rank -> the address each rank registered at (the collective manager's log lines)."""
    addresses = {}
    for line in server.log_lines("registered at"):
        rank = int(line.split("rank ")[1].split()[0])
        addresses[rank] = line.strip().rsplit(" ", 1)[1]
    return addresses


def two_requests_sharing_a_prefix(server, tag, offset):
    """Two completions whose prompts share 2,500 characters and differ after; their usages
    (each generated tokens).  Xinference sends them to different replicas."""
    text = open(os.__file__).read()
    prefix = text[:2500]
    usages = [server.call("POST", "/v1/completions", {
        "model": MODEL,
        "prompt": prefix + f"\n# {tag} {i}\n" + text[offset + 100 * i:offset + 100 + 100 * i],
        "max_tokens": 8, "temperature": 0})["usage"] for i in range(2)]
    assert all(u["completion_tokens"] > 0 for u in usages)
    return usages


def completion(server, prompt, max_tokens=8):
    return server.call("POST", "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_rest_launch_routes_by_cache_shares_prefixes_and_cleans_up(tiny_model_dir,
                                                                   xinference_server):
    """A REST launch with Xavier in an authenticated deployment (the server's pools and
    engines hold ``XOSCAR_AUTH_KEY``), routed by cache (``xavier_routing`` ``cache_aware``,
    the default): a follow-up goes to the replica that computed its prefix (no load
    needed); once that replica holds more than its share in flight the next request goes
    to the other one, which loads the prefix; a client without the key, or with another,
    is refused by a replica's transfer actor that answers the same call with it."""
    server = xinference_server
    envs = xavier_envs()
    assert server.launch(launch_body(tiny_model_dir, envs)) == {"model_uid": MODEL}
    # our hook classes did the work (upstream's would not log these)
    registered = server.log_lines("xavier.collective_manager")
    assert sum(f"rank {r} registered at" in line for line in registered
               for r in (0, 1, 2)) == 3
    attached = server.log_lines("init_xavier: workers attached=True")
    assert len(attached) == 2
    addresses = rank_addresses(server)
    text = open(os.__file__).read()
    prefix = text[:2500]
    start = routed(server)

    # one after another: the follow-up lands where its prefix was computed
    for i in range(2):
        assert completion(server, prefix + f"\n# request {i}\n"
                          + text[7000 + 100 * i:7100 + 100 * i])["usage"]["completion_tokens"] > 0
    first = routed(server, start)
    print("routed, one after another:", first)
    ((warm, _),) = [k for k in first if k[1] == "load"]
    assert first == {(warm, "load"): 1, (warm, "affinity"): 1}
    c = {r: server.counters(addresses[r], r) for r in (1, 2)}
    assert sum(c[r].get("requests_with_hits", 0) for r in (1, 2)) == 0  # a local hit

    # four at once: three stay with the warm replica (in flight there: 0, 1, 2), the
    # fourth finds it holding more than 1.5 x the other's + 2 and goes to the cold one,
    # which loads the prefix from the warm one's vLLM cache
    barrier = threading.Barrier(4)

    def concurrent(i):
        barrier.wait()
        return completion(server, prefix + f"\n# burst {i}\n"
                          + text[12000 + 1500 * i:13500 + 1500 * i], max_tokens=32)

    with concurrent_futures.ThreadPoolExecutor(4) as pool:
        usages = [r["usage"] for r in pool.map(concurrent, range(4))]
    assert all(u["completion_tokens"] > 0 for u in usages)
    after = routed(server, start)
    cold = "1" if warm == "0" else "0"
    print("routed, four at once:", after)
    assert after == {(warm, "load"): 1, (warm, "affinity"): 4, (cold, "load"): 1}
    c = {r: server.counters(addresses[r], r) for r in (1, 2)}
    print("xavier counters per rank:", {r: {k: c[r].get(k, 0) for k in (
        "requests_with_hits", "hit_blocks", "hit_tokens", "batch_calls", "blocks_written",
        "export_exported", "rows_from_gpu_tier", "rows_from_cpu_tier",
        "rows_from_vllm_cache", "in_place_registered", "load_failures")}
        for r in (1, 2)}, "usages:", usages)
    cold_rank = int(cold) + 1
    assert c[cold_rank].get("requests_with_hits", 0) == 1
    assert c[cold_rank].get("hit_blocks", 0) >= 2500 // 4 // 16
    assert c[cold_rank].get("batch_calls", 0) == 1
    assert c[3 - cold_rank].get("requests_with_hits", 0) == 0
    assert sum(c[r].get("load_failures", 0) for r in (1, 2)) == 0
    # read in place from the other replica's vLLM cache (the default)
    assert sum(c[r].get("rows_from_vllm_cache", 0) for r in (1, 2)) == sum(
        c[r].get("hit_blocks", 0) for r in (1, 2))
    # the negative control: the call that just answered, without the key and with another
    for key in (None, "another-key"):
        refused = server.actor_call(addresses[1], "vllm-transfer-actor-1", "counters", key)
        assert refused.startswith("REFUSED ServerClosed"), (key, refused)

    # the same counters on the worker's metrics endpoint, per replica (sent every 5 s)
    endpoint = metrics_endpoint(server.home)
    series = wait_for_series(endpoint, "xinference:xavier_hit_blocks_total", 2, 30)
    print("worker metrics:", endpoint, series)
    assert sorted(labels["replica"] for labels, _ in series) == ["0", "1"]
    assert {labels["model"] for labels, _ in series} == {MODEL}
    hit_blocks = {int(labels["replica"]) + 1: value for labels, value in series}
    assert hit_blocks == {r: c[r].get("hit_blocks", 0) for r in (1, 2)}

    the_warm_replica_dies_and_comes_back(server, int(warm), text, prefix)

    assert server.call("DELETE", f"/v1/models/{MODEL}") is None
    assert server.engines_gone() == []
    assert server.call("GET", "/v1/models")["data"] == []
    # a terminated model's series are gone from the worker's metrics
    assert scrape(endpoint, "xinference:xavier_hit_blocks_total") == []

    # a bad option fails the launch and names it; nothing stays behind
    bad = dict(envs, XAVIER_CPU_BUDGET="lots")
    with pytest.raises(urllib.error.HTTPError) as err:
        server.call("POST", "/v1/models", launch_body(tiny_model_dir, bad))
    detail = json.loads(err.value.read())["detail"]
    assert "xavier_cpu_budget: 'lots' is not a size" in detail
    assert server.call("GET", "/v1/models")["data"] == []
    time.sleep(2)
    assert server.engine_cores() == []

    # checked in the supervisor before any engine starts (the overlay's wrapper of
    # launch_builtin_model): the CLI's spelling, a strict switch, replicas, env names
    fast = {
        "enable_xavier: expected true or false, got 'maybe'": {"enable_xavier": "maybe"},
        "enable_xavier: expected true or false, got 'sure'": {"enable-xavier": "sure"},
        "enable_xavier: shares prefixes between replicas and needs replica >= 2": {
            "replica": 1},
        "XAVIER_CPU_BUGDET: unknown Xavier setting; did you mean XAVIER_CPU_BUDGET?": {
            "envs": {"XAVIER_CPU_BUGDET": "64MiB"}},
        "xavier_routing: expected one of cache_aware, round_robin, got 'nearest'": {
            "xavier_routing": "nearest"},
    }
    for message, change in fast.items():
        body = launch_body(tiny_model_dir, envs)
        if "enable-xavier" in change:
            body.pop("enable_xavier")
        body.update(change)
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as err:
            server.call("POST", "/v1/models", body)
        print(f"refused in {time.monotonic() - t0:.2f} s: {message}")
        assert message in json.loads(err.value.read())["detail"]
    assert server.call("GET", "/v1/models")["data"] == []
    assert server.engine_cores() == []

    # the CLI, with the card's spelling: a refused option exits non-zero at once, with
    # the message
    refused = cli_launch(server, tiny_model_dir, "--enable-xavier", "maybe")
    assert refused.returncode != 0
    assert "enable_xavier: expected true or false, got 'maybe'" in refused.stderr
    assert server.call("GET", "/v1/models")["data"] == []
    # a launch that fails only after its engines started (a CPU tier that holds no
    # block is found out when the workers attach) exits non-zero too, with the message
    # (the overlay's wrapper of the CLI waits for the whole launch; upstream's exits 0
    # as soon as the engines are loaded); nothing stays
    late = cli_launch(server, tiny_model_dir, "--enable-xavier", "true",
                      "--env", "XAVIER_CPU_BUDGET", "1KiB")
    print("late failure:", late.returncode, late.stderr[-600:])
    assert late.returncode == 1
    assert "Error: the Xavier launch failed: xavier_cpu_budget" in late.stderr
    assert re.search(r"xavier_cpu_budget: .*1024 bytes.* smaller than one KV block",
                     late.stderr), late.stderr[-600:]
    assert server.engines_gone() == []


def the_warm_replica_dies_and_comes_back(server, victim, text, prefix):
    """Replica recovery with routing on (#37): the process of replica ``victim`` (holding
    ``prefix``) is killed.  Xinference's worker reloads it and keeps it in its replica list
    and its round robin meanwhile (a request sent there gets an error); the router leaves
    it out while its worker reports it out of service: every request of the gap, the
    prefix's follow-up included, is served by the other replica; once it serves again,
    new prefixes go to it too.  The killed replica's engine does not outlive it."""
    other = 1 - victim
    process = model_process(server, victim)
    engines = engine_cores(process.pid)
    assert engines, "the replica's vLLM engine core"
    process.kill()
    wait_until(lambda: replica_statuses(server)[victim] != "READY", 60,
               "Xinference marking the replica out of service")
    time.sleep(replica_routing.INFO_TTL_S + 0.5)  # the router's view of it refreshed
    start = routed(server)
    asks = [prefix + "\n# during the reload\n" + text[20000:20100],  # its prefix's follow-up
            text[21000:23500] + "\n# a new one\n", text[24000:26500] + "\n# another\n"]
    for ask in asks:
        assert completion(server, ask)["usage"]["completion_tokens"] > 0
    # the negative control: Xinference's own cycle (what a request without Xavier's router
    # gets) still hands out the reloading replica, which refuses
    supervisor = server.call("GET", "/v1/address")
    upstream = [server.actor_call(supervisor, "supervisor", "get_model", args=[MODEL])
                for _ in range(2)]
    print("Xinference's cycle during the reload:", upstream)
    assert sum(a.startswith("REFUSED") and "stopping" in a for a in upstream) == 1, upstream
    during = routed(server, start)
    statuses = replica_statuses(server)
    print("routed while the replica reloads:", during, "statuses after them:", statuses)
    assert statuses[victim] != "READY"  # the requests above all came during the gap
    assert set(during) <= {(str(other), "affinity"), (str(other), "load")}, during
    assert sum(during.values()) == len(asks)
    wait_until(lambda: replica_statuses(server)[victim] == "READY", 300,
               "the replica reloaded")
    assert server.log_lines(f"Recreating model actor {MODEL}-rep{victim}")  # (the worker's)
    assert server.log_lines(f"replicas out of service (their workers say so): [{victim}]")
    time.sleep(replica_routing.INFO_TTL_S + 0.5)
    start = routed(server)
    for i in range(2):  # new prefixes: the least loaded replica, in turn
        assert completion(server, text[27000 + 3000 * i:29500 + 3000 * i]
                          + f"\n# after {i}\n")["usage"]["completion_tokens"] > 0
    after = routed(server, start)
    print("routed once it serves again:", after)
    assert after == {(str(victim), "load"): 1, (str(other), "load"): 1}, after
    assert alive(engines) == []  # the killed replica's engine core went with it


def wait_until(ready, timeout, what):
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.5)


def test_rest_launch_of_tensor_parallel_replicas_shares_every_shard(tiny_model_dir,
                                                                  xinference_server):
    """``"tensor_parallel_size": 2`` beside ``"enable_xavier": true``: each replica is one
    vLLM engine of two workers (each holds one of the tiny model's two KV heads), every
    worker attaches with its own shard, and a prefix one replica computed is loaded by the
    other on both shards.  On this 2-core machine vLLM's CPU build runs TP=2 with one OpenMP
    thread per worker, bound through the launch's ``envs`` (``VLLM_CPU_OMP_THREADS_BIND``)."""

    server = xinference_server
    envs = xavier_envs()
    if DEVICE == "cpu":
        envs["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    body = launch_body(tiny_model_dir, envs)
    body["tensor_parallel_size"] = 2
    body["xavier_routing"] = "round_robin"  # Xinference's cycle: the two go to both
    if DEVICE == "cuda":  # each replica on both GPUs
        body["gpu_idx"] = [0, 1]
    assert server.launch(body) == {"model_uid": MODEL}
    # each replica's transfer actor took one storage per worker (shard)
    workers = server.log_lines("registered (cpu" if DEVICE == "cpu" else "registered (cuda")
    for rank in (1, 2):
        for k in (0, 1):
            assert sum(f"rank {rank}: engine worker {k}/2" in line
                       for line in workers) == 1, (rank, k, workers)
    assert len(server.log_lines("init_xavier: workers attached=True")) == 2
    addresses = rank_addresses(server)
    usages = two_requests_sharing_a_prefix(server, "tp request", 9000)
    c = {r: server.counters(addresses[r], r) for r in (1, 2)}
    total = {k: sum(c[r].get(k, 0) for r in (1, 2)) for k in (
        "requests_with_hits", "hit_blocks", "batch_calls", "blocks_written",
        "load_failures")}
    print("xavier counters, both replicas:", total, "usages:", usages)
    assert total["requests_with_hits"] == 1
    assert total["hit_blocks"] >= 2500 // 4 // 16
    assert total["blocks_written"] == 2 * total["hit_blocks"]  # both shards of each
    assert total["batch_calls"] == 2  # one load call per worker
    assert total["load_failures"] == 0

    assert server.call("DELETE", f"/v1/models/{MODEL}") is None
    assert server.engines_gone() == []
    assert server.call("GET", "/v1/models")["data"] == []
