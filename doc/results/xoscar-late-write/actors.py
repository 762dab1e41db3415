import asyncio, time
import numpy as np
import xoscar as xo

WRITE_LOG = []  # (t, uid, start, len, first_byte, status) in the receiving pool


def install_write_log():
    from xoscar.backends.indigen.pool import MainActorPool
    from xoscar.backends.message import MessageType
    orig = MainActorPool._message_handler[MessageType.copy_to_buffers]

    async def logged(self, message):
        for addr, uid, start, ln, data in message.content:
            WRITE_LOG.append((time.time(), uid[:3].hex(), start, ln,
                              (bytes(memoryview(data)[:1]) or b"\xff")[0]))
        try:
            return await orig(self, message)
        except BaseException as e:
            WRITE_LOG.append((time.time(), "ERR", 0, 0, repr(e)[:60]))
            raise
    MainActorPool._message_handler[MessageType.copy_to_buffers] = logged


def ts():
    return time.time()


class S(xo.StatelessActor):
    async def serve_blocks(self, tag, fill, row_bytes, nrows, refs, delay_before,
                           block_size=None, slow_cancel=0.0):
        rows = [np.full(row_bytes, fill, np.uint8) for _ in range(nrows)]
        ev = [("S start", tag, ts())]
        try:
            await asyncio.sleep(delay_before)
            ev.append(("S copy_to begin", tag, ts()))
            await xo.copy_to(rows, refs, block_size=block_size)
        except asyncio.CancelledError:
            print(f"  [S] {tag}: CancelledError at {ts():.3f}", flush=True)
            if slow_cancel:
                await asyncio.shield(asyncio.sleep(slow_cancel))  # slow cleanup
                print(f"  [S] {tag}: cleanup done, re-raising at {ts():.3f}", flush=True)
            raise
        print(f"  [S] {tag}: copy_to returned at {ts():.3f}", flush=True)
        return row_bytes * nrows


class _LBase:
    async def __post_create__(self):
        self.stage = np.zeros((8, 8 << 20), np.uint8)   # 8 rows x 8 MiB, persistent
        self.events = []

    async def fetch_blocks(self, tag, src, fill, nrows, delay_before, block_size=None,
                           slow_cancel=0.0, nbytes=None):
        nbytes = nbytes or self.stage.shape[1]
        self.events.append(("L start", tag, ts()))
        rows = [self.stage[i, :nbytes] for i in range(nrows)]          # per-call views, as product
        refs = [xo.buffer_ref(self.address, r) for r in rows]
        try:
            n = await src.serve_blocks(tag, fill, nbytes, nrows, refs,
                                       delay_before, block_size, slow_cancel)
        except asyncio.CancelledError:
            self.events.append(("L raised CancelledError", tag, ts()))
            raise
        self.events.append(("L returned", tag, ts()))
        return n

    def report(self):
        first = [int(self.stage[i, 0]) for i in range(8)]
        last = [int(self.stage[i, -1]) for i in range(8)]
        ev, wl = list(self.events), list(WRITE_LOG)
        self.events.clear(); WRITE_LOG.clear()
        return ev, wl, first, last

    def heads(self):
        return [hex(int(self.stage[i, 0])) for i in range(4)]

    def reset(self):
        self.stage[:] = 0
        self.events.clear(); WRITE_LOG.clear()


class LStateless(_LBase, xo.StatelessActor):
    pass


class LLocked(_LBase, xo.Actor):
    pass
