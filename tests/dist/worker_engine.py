"""fusedist.models.Engine at TP = the world size (CPU / gloo or one GPU per rank): the
AsyncEngine leader (rank 0) takes requests and broadcasts each step's events, the other ranks
follow; every rank takes the same decisions (the same outputs on every rank, equal to
Engine.generate at TP 1 for greedy requests and seeded ones), pages are released everywhere;
with the engine's overlap (launched-ahead decode steps) and without.

    torchrun --nproc-per-node 2 tests/dist/worker_engine.py CHECKPOINT_DIR
"""

from __future__ import annotations

import asyncio
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import fusedist  # noqa: E402
from fusedist.models import LLM  # noqa: E402
from fusedist.models.async_engine import AsyncEngine  # noqa: E402
from fusedist.models.sampler import GenerationParams  # noqa: E402
from fusedist.models.scheduler import Engine  # noqa: E402


def main() -> None:
    ckpt = sys.argv[1]
    llm = LLM(ckpt, max_batch=1, max_seq_len=64)
    rt = fusedist.get_runtime()
    failures = []
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 256, (n,), generator=g).tolist() for n in (5, 23, 12, 30)]
    params = [GenerationParams(max_tokens=7, temperature=0, ignore_eos=True),
              GenerationParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=5, n=2,
                               ignore_eos=True),
              GenerationParams(max_tokens=6, temperature=0, ignore_eos=True),
              GenerationParams(max_tokens=8, temperature=1.0, seed=9, ignore_eos=True)]
    try:
        assert rt.tp.size == rt.world_size == int(os.environ["WORLD_SIZE"]), rt.tp.size
        want = None
        for overlap in (False, True):   # the launched-ahead steps, decided alike on every rank
            eng = Engine.from_llm(llm, max_seqs=3, max_num_batched_tokens=11, num_pages=8,
                                  overlap=overlap)
            got = [[c.ids for c in o.choices] for o in eng.generate(prompts, params)]
            want = got if want is None else want
            assert got == want, f"overlap={overlap}: generate {got} != without overlap {want}"
            ae = AsyncEngine(eng)
            if ae.leader:
                ae.start()

                async def run():
                    return await asyncio.gather(*(ae.generate(p, sp)
                                                  for p, sp in zip(prompts, params)))
                got = [[c.ids for c in o.choices] for o in asyncio.run(run())]
                assert got == want, f"overlap={overlap}: served {got} != generate {want}"
                ae.shutdown()
            else:
                ae.follow()
            assert not eng.requests and eng.pool.num_free == eng.pool.total, "pages leaked"
            eng.pool.check()
            assert (eng.stats.overlapped_steps > 0) == overlap, eng.stats
            every = rt.world.all_gather_object((eng.stats.steps, eng.stats.preemptions,
                                                eng.stats.overlapped_steps,
                                                sorted(eng.pool.index.items())))
            assert all(e == every[0] for e in every), \
                f"overlap={overlap}: ranks took different decisions: {every}"
            eng.close()
    except Exception as e:  # noqa: BLE001 - gathered below
        failures.append(f"rank {rt.rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    gathered = rt.world.all_gather_object(failures)
    llm.close()
    flat = [f for fs in gathered for f in fs]
    if flat:
        print("\n".join(flat), flush=True)
        sys.exit(1)
    print(f"rank {rt.rank}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
