"""Child process of :class:`tests.support.engines.EngineProcess`.

argv[1]: JSON of ``vllm.LLM`` keyword arguments.  Protocol: one JSON object
per line on stdin (``{"op": "generate", "prompts": [...], "max_tokens": n}``,
``{"op": "settings"}`` or ``{"op": "exit"}``), one JSON reply per line on stdout.  vLLM's own output
goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    kwargs = json.loads(sys.argv[1])
    # keep the protocol channel clean: the protocol gets a private copy of fd 1, and
    # fd 1 itself (inherited by vLLM's spawned processes too) now points at stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams

    llm = LLM(**kwargs)
    out.write(json.dumps({"status": "ready", "pid": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("op") == "exit":
            break
        if msg.get("op") == "settings":  # the KV cache as vLLM sized it
            cfg = llm.llm_engine.vllm_config
            out.write(json.dumps({
                "num_gpu_blocks": int(cfg.cache_config.num_gpu_blocks or 0),
                "hybrid_kv_cache_manager":
                    not cfg.scheduler_config.disable_hybrid_kv_cache_manager}) + "\n")
            out.flush()
            continue
        try:
            params = SamplingParams(temperature=0.0, max_tokens=int(msg["max_tokens"]),
                                    ignore_eos=True)
            res = llm.generate(msg["prompts"], params, use_tqdm=False)
            reply = {"ids": [list(r.outputs[0].token_ids) for r in res],
                     "cached": [int(r.num_cached_tokens or 0) for r in res],
                     "prompt_len": [len(r.prompt_token_ids or []) for r in res]}
        except Exception as exc:  # report, keep serving
            reply = {"error": repr(exc)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
