import os, sys, torch
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from collections import deque
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.utils.hashing import sha256
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
import simconn

ASYNC = sys.argv[1] == "async"
PROMPT = int(sys.argv[2]) if len(sys.argv) > 2 else 80   # tokens
NEXT = int(sys.argv[3]) if len(sys.argv) > 3 else 64      # sync-loaded tokens
BUDGET = int(sys.argv[4]) if len(sys.argv) > 4 else 512
BS = 16
mc = ModelConfig(model=os.path.join(HERE, "tinymodel"), skip_tokenizer_init=True, dtype="float16", seed=0)
sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET, max_model_len=2048,
                     enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=ASYNC)
cc = CacheConfig(block_size=BS, enable_prefix_caching=True)
kt = KVTransferConfig(kv_connector="SimConnector", kv_connector_module_path="simconn", kv_role="kv_both",
                      kv_load_failure_policy="recompute")
vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kt, device_config=DeviceConfig("cpu"))
vc.cache_config.num_gpu_blocks = 1000
kvc = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32))])
cls = AsyncScheduler if ASYNC else Scheduler
s = cls(vllm_config=vc, kv_cache_config=kvc, log_stats=False, structured_output_manager=StructuredOutputManager(vc), block_size=BS)
print("scheduler:", type(s).__name__, "policy recompute:", s.recompute_kv_load_failures)
init_none_hash(sha256)
sp = SamplingParams(max_tokens=5, ignore_eos=True)
req = Request(request_id="R", prompt_token_ids=list(range(3, 3 + PROMPT)), sampling_params=sp, pooling_params=None,
              block_hasher=get_request_block_hasher(BS, sha256))
simconn.SimConnector.MATCH["R"] = NEXT
s.add_request(req)

step = 0
failed_once = False
queue = deque()
depth = 2 if ASYNC else 1
emitted = []
def run_model(so, stepno):
    global failed_once
    rids = list(so.num_scheduled_tokens)
    inv = set()
    if not failed_once and so.scheduled_new_reqs:
        # fail block idx 1 of R's sync load
        bids = so.scheduled_new_reqs[0].block_ids[0]
        inv = {bids[1]}
        failed_once = True
    toks = []
    cr = so.scheduled_cached_reqs
    start = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    start.update({r: cr.num_computed_tokens[i] for i, r in enumerate(cr.req_ids)})
    for r in rids:
        end = start[r] + so.num_scheduled_tokens[r]
        toks.append([] if end < s.requests[r].num_prompt_tokens else [1000 + stepno])
    return ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
        sampled_token_ids=toks, logprobs=None, prompt_logprobs_dict={}, pooler_output=None,
        kv_connector_output=KVConnectorOutput(invalid_block_ids=inv))

for it in range(30):
    if s.has_requests():
        so = s.schedule()
        if so.total_num_scheduled_tokens > 0:
            step += 1
            cr = so.scheduled_cached_reqs
            info = {r: (cr.num_computed_tokens[i], cr.num_output_tokens[i]) for i, r in enumerate(cr.req_ids)}
            new = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
            print(f"SCHED step{step}: sched={dict(so.num_scheduled_tokens)} new(ncomp)={new} cached(ncomp,nout)={info} "
                  f"-> req.ncomp={req.num_computed_tokens} placeholders={req.num_output_placeholders}")
            queue.append((so, run_model(so, step), step))
            if len(queue) < depth:
                continue
    if not queue:
        break
    so, out, st = queue.popleft()
    # model samples only for requests whose step finished prefill; mimic runner: discard partial-prefill samples
    res = s.update_from_output(so, out)
    for eco in res.values():
        for o in eco.outputs:
            emitted.extend(o.new_token_ids)
    inv = out.kv_connector_output.invalid_block_ids
    print(f"  OUTPUT of step{st} processed (invalid={bool(inv)}): req.ncomp={req.num_computed_tokens} "
          f"placeholders={req.num_output_placeholders} output_tokens={list(req.output_token_ids)} status={req.status.name}")
    if req.is_finished():
        break
print("EMITTED:", emitted)
