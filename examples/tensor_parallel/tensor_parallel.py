"""Tensor parallelism with pagedkv: the KV heads split over the ranks, one pool per rank.

  python3 examples/tensor_parallel/tensor_parallel.py --backend cuda --format f16   # two GPUs, NCCL
  torchrun --nproc-per-node 2 examples/tensor_parallel/tensor_parallel.py          # the same, by torchrun
  python3 examples/tensor_parallel/tensor_parallel.py --backend cpu                # two host processes, gloo

What the engine does: it gives rank r the KV heads [r h, (r + 1) h) (h = kv_heads / world) and the
query heads of their groups, as its attention projections' shards would produce them; each rank
keeps a pool of h KV heads, appends and writes its heads' rows, prefills and decodes them; an
all-gather joins the ranks' attention outputs along the heads (the output projection's input).
What pagedkv does: each rank's pool is an ordinary pool of h heads; nothing in it knows of the
others. Rank 0 also runs the model step in one pool of every head and compares: the same bits
where each rank's decode splits its sequences as the whole pool does (the planner weighs the
heads, so a rank's plan may differ), else within float32 rounding of the merge.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distributed_common as common  # noqa: E402
import pagedkv  # noqa: E402


def step_outputs(pool: pagedkv.Pool, lens: List[int], args, heads: slice, dev) -> List[torch.Tensor]:
    """Prefill of the prompts, then --steps decode steps, for the model's KV heads `heads`; each call's
    attention output (the prefill's, then each decode's), [tokens, query heads, head_dim]."""
    seqs = [pool.alloc() for _ in lens]
    outs = common.prefill(pool, seqs, lens, args, dev, heads) + common.decode_steps(pool, seqs, args, dev, heads)
    for s in seqs:
        s.free()
    return outs


def pool_of(ctx: pagedkv.Context, args, kv_heads: int, lens: List[int], salt: int) -> pagedkv.Pool:
    pages = sum((n + args.steps) // args.page_size + 2 for n in lens)
    return ctx.pool(layers=args.layers, kv_heads=kv_heads, head_dim=args.head_dim, page_size=args.page_size,
                    pages=pages, max_sequences=len(lens), max_sequence_length=max(lens) + args.steps + 1,
                    k_format=args.format, v_format=args.format, page_order_seed=common.page_order(args, salt))


def main(rank: int, world: int, args) -> bool:
    if args.kv_heads % world:
        raise SystemExit(f"tensor_parallel: {args.kv_heads} KV heads do not split over {world} ranks")
    dev = common.device(args)
    g = torch.Generator().manual_seed(args.seed)
    lens = [int(x) for x in torch.randint(1, args.longest + 1, (args.prompts,), generator=g)]
    h = args.kv_heads // world
    with common.context(args) as ctx:
        with pool_of(ctx, args, h, lens, rank) as pool:
            mine = step_outputs(pool, lens, args, slice(rank * h, (rank + 1) * h), dev)
        joined = []
        for out in mine:  # the ranks' query heads side by side, as the output projection takes them
            parts = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(parts, out.contiguous())
            joined.append(torch.cat(parts, dim=1))
        if rank != 0:
            return True
        with pool_of(ctx, args, args.kv_heads, lens, world) as whole:
            want = step_outputs(whole, lens, args, slice(0, args.kv_heads), dev)
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(joined, want))
    worst = max(float(((a.float() - b.float()).abs() / (b.float().abs() + 1e-3)).max()) for a, b in zip(joined, want))
    what = f"{len(want)} calls ({args.layers} layers: prefill and {args.steps} decode steps) over {world} ranks"
    return common.report(rank, worst <= 4e-3, f"{what} equal one pool of every head: "
                         f"{'the same bits' if same else f'worst relative difference {worst:.2e}'}")


if __name__ == "__main__":
    a = common.options(__doc__.split("\n")[0]).parse_args()
    print(f"tensor_parallel: --seed {a.seed} --backend {a.backend} --format {a.format}", flush=True)
    sys.exit(common.launch(main, a))
