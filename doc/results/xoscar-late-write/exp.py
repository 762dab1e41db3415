"""W (this process, own loop thread) -> L (pool P_L) -> S (pool P_S / P_S2); sockets channel."""
import asyncio, concurrent.futures as cf, socket, subprocess, sys, threading, time
import os as _os; sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
import xoscar as xo
import actors

PY = sys.executable

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

addrs = {k: f"127.0.0.1:{free_port()}" for k in ("P_L", "P_S", "P_S2")}
import atexit, os
procs = [subprocess.Popen([PY, _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "pool.py"), a], stdout=subprocess.PIPE, text=True)
         for a in addrs.values()]
def _stop():
    for p in procs:
        if p.poll() is None: p.terminate()
    for p in procs: p.wait()
atexit.register(_stop)
for p in procs: p.stdout.readline()   # "pool up"

loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
atexit.register(lambda: loop.call_soon_threadsafe(loop.stop))
def call(coro_fn, timeout=10):
    fut = asyncio.run_coroutine_threadsafe(coro_fn(), loop)
    return fut, fut.result(timeout) if timeout is not None else None

def W(make, timeout):
    """Like actor_bridge.call: result(timeout) then fut.cancel()."""
    fut = asyncio.run_coroutine_threadsafe(make(), loop)
    t0 = time.time()
    try:
        return "ok", fut.result(timeout), t0, time.time()
    except cf.TimeoutError:
        c = fut.cancel()
        return f"timeout (cancel()={c})", None, t0, time.time()

async def setup():
    L = await xo.create_actor(actors.LStateless, address=addrs["P_L"], uid="Ls")
    LL = await xo.create_actor(actors.LLocked, address=addrs["P_L"], uid="Ll")
    S = await xo.create_actor(actors.S, address=addrs["P_S"], uid="S")
    S2 = await xo.create_actor(actors.S, address=addrs["P_S2"], uid="S2")
    return L, LL, S, S2
_, (L, LL, S, S2) = call(setup)

def show(tref, label, L_=None):
    time.sleep(0.6)
    _, (ev, wl, first, last) = call(lambda: (L_ or L).report())
    print(f"--- {label}: timeline (ms, relative to W's cancel)")
    for name, tag, t in ev:
        print(f"  {1000*(t-tref):8.1f}  {name} [{tag}]")
    for t, uid, start, ln, fb in wl:
        if ln == 0: continue  # copy_to's empty split items
        print(f"  {1000*(t-tref):8.1f}  P_L write uid={uid} off={start} len={ln} byte=0x{fb:02x}"
              if uid != "ERR" else f"  {1000*(t-tref):8.1f}  P_L write FAILED {fb}")
    print("  final rows first byte:", [hex(x) for x in first], " last byte:", [hex(x) for x in last])

TRIALS = [(0.33, None, S2, None), (0.34, 8 << 20, S2, None), (0.34, 8 << 20, S2, 65536),
          (0.36, 8 << 20, S2, 65536), (0.34, 8 << 20, S, 65536), (0.36, 8 << 20, S, 65536)]
for trial, (tmo, bs, src2, nb2) in enumerate(TRIALS):
    call(lambda: L.reset())
    st, _, t0, t1 = W(lambda: L.fetch_blocks("call1", S, 0x11, 4, 0.3, bs), tmo)
    print(f"\n=== Q3 trial {trial}: block_size={bs or '4MiB default'}, call2 from "
          f"{'S2 (other pool)' if src2 is S2 else 'S (same pool)'}, call2 bytes/row={nb2 or 'full'}; W call1 -> {st}; "
          f"W back after {1000*(t1-t0):.1f} ms")
    # W immediately retries into the same staging rows from another source
    st2, r2, _, t2 = W(lambda: L.fetch_blocks("call2", src2, 0x22, 4, 0.0, bs, 0.0, nb2), 5)
    _, h = call(lambda: L.heads())
    print(f"  W call2 -> {st2} at {1000*(t2-t1):.1f} ms; rows[:4] byte0 seen by W right after call2: {h}")
    show(t1, f"trial {trial}")

call(lambda: L.reset())
st, _, t0, t1 = W(lambda: L.fetch_blocks("slowcancel", S, 0x33, 1, 1.0, None, 0.4), 0.2)
print(f"\n=== Q1/Q2: S sleeps 1 s, its cancel cleanup takes 0.4 s; W -> {st}, "
      f"W back after {1000*(t1-t0):.1f} ms")
show(t1, "slow cancel"); time.sleep(0.2)

for name, ref in (("StatelessActor", L), ("Actor", LL)):
    call(lambda: ref.reset())
    async def two():
        return await asyncio.gather(ref.fetch_blocks("a", S, 0x44, 1, 0.3),
                                    ref.fetch_blocks("b", S, 0x55, 1, 0.3))
    t0 = time.time(); call(two)
    print(f"\n=== Q4 {name}: two overlapping fetch_blocks took {1000*(time.time()-t0):.0f} ms")
    show(t0, name, ref)

