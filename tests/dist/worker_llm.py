"""fusedist.models.LLM at TP = the world size (CPU / gloo or one GPU per rank): it initializes
fusedist itself, every rank gets the same ids, stream() yields generate()'s ids, and greedy ids
equal Hugging Face's generate() on the same checkpoint.

    torchrun --nproc-per-node 2 tests/dist/worker_llm.py CHECKPOINT_DIR
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "models"))

import torch  # noqa: E402

import fusedist  # noqa: E402
from fusedist.models import LLM  # noqa: E402


def main() -> None:
    ckpt = sys.argv[1]
    llm = LLM(ckpt, max_batch=2, max_seq_len=64)
    rt = fusedist.get_runtime()
    failures = []
    try:
        assert rt.tp.size == rt.world_size == int(os.environ["WORLD_SIZE"]), rt.tp.size
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(4, 256, (n,), generator=g).tolist() for n in (6, 10)]
        want = llm.generate(prompts, 8, greedy=True, eos_ids=())
        steps = list(llm.stream(prompts, 8, greedy=True, eos_ids=()))
        for i, w in enumerate(want):
            got = [s[i].id for s in steps]
            assert got == w.ids, f"stream {got} != generate {w.ids}"
        every = rt.world.all_gather_object([w.ids for w in want])
        assert all(e == every[0] for e in every), f"ranks differ: {every}"
        from hf_tiny import load_hf

        hf = load_hf(ckpt)
        for p, w in zip(prompts, want):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert w.ids == ref, f"TP {rt.tp.size} ids {w.ids} != HF {ref}"
        text = "".join(t.text for t in llm.stream("w3 w9 w27", 6, greedy=True, eos_ids=()))
        assert text == llm.generate("w3 w9 w27", 6, greedy=True, eos_ids=()).text
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
