import asyncio, sys
import os as _os; sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
import actors, xoscar as xo

async def main(addr):
    actors.install_write_log()
    pool = await xo.create_actor_pool(addr, n_process=0)
    print("pool up", addr, flush=True)
    await pool.join()

asyncio.run(main(sys.argv[1]))
