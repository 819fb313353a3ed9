"""Disaggregated serving with pagedkv: rank 0 prefills, rank 1 decodes, the K/V pages move between
them with torch.distributed send/recv straight between the two pools' memory.

  python3 examples/disaggregated/disaggregated.py --backend cuda --format q4_0    # two GPUs, NCCL
  torchrun --nproc-per-node 2 examples/disaggregated/disaggregated.py             # the same, by torchrun
  python3 examples/disaggregated/disaggregated.py --backend cpu                   # two host processes, gloo

Rank 0 owns a pool, appends a batch of ragged prompts, writes their K/V for every layer and runs the
prefill's attention (Pool.extend). Rank 1 makes sequences of the same lengths in its own pool
(Pool.append: pages taken, not written), and the ranks exchange where the sequences' pages lie
(Sequence.page_spans: [layer][page][K, V] in both pools, the same bytes each); spans adjacent in
both pools join into one message, and each is sent from rank 0's pool memory into rank 1's (no
host copy on GPUs). Rank 1 then decodes --steps tokens (append, write, decode every layer). It
also runs the whole thing in a pool of its own, prefill included, and checks that the transferred
sequences decode to the same bits at every step. A failed transfer frees the receiving sequences:
the pool is as before. --bench-tokens N times the transfer of one N-token sequence of 32 layers
against a send of the same bytes from one buffer.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distributed_common as common  # noqa: E402
import pagedkv  # noqa: E402

PREFILL, DECODE = 0, 1


def lengths(args) -> List[int]:
    g = torch.Generator().manual_seed(args.seed)
    return [int(x) for x in torch.randint(1, args.longest + 1, (args.prompts,), generator=g)]


def pool_of(ctx: pagedkv.Context, args, layers: int, tokens: int, sequences: int, salt: int) -> pagedkv.Pool:
    pages = sequences * ((tokens + args.steps) // args.page_size + 2)
    return ctx.pool(layers=layers, kv_heads=args.kv_heads, head_dim=args.head_dim, page_size=args.page_size,
                    pages=pages, max_sequences=sequences, max_sequence_length=tokens + args.steps + 1,
                    k_format=args.format, v_format=args.format, page_order_seed=common.page_order(args, salt))


def span_table(seqs) -> torch.Tensor:
    """[n, 3] int64: each span's region, offset and bytes, the sequences' spans one after another."""
    return torch.tensor([[s.region, s.offset, s.bytes] for seq in seqs for s in seq.page_spans()], dtype=torch.int64)


def exchange(table: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's span table for the other's (a count, then the rows; rank 0 sends first)."""
    peer = 1 - rank
    count, theirs_count = torch.tensor([table.shape[0]], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    ops = [lambda: dist.send(count, peer), lambda: dist.recv(theirs_count, peer)]
    for op in ops if rank == PREFILL else ops[::-1]:
        op()
    theirs = torch.zeros(int(theirs_count), 3, dtype=torch.int64)
    ops = [lambda: dist.send(table, peer), lambda: dist.recv(theirs, peer)]
    for op in ops if rank == PREFILL else ops[::-1]:
        op()
    return theirs


def messages(mine: torch.Tensor, theirs: torch.Tensor) -> List[Tuple[int, int, int, int, int]]:
    """(my region, my offset, their region, their offset, bytes) of each message: spans in the same
    place of both tables hold the same bytes; consecutive spans adjacent in both pools' memory join.
    Pools of different geometry give tables that differ: a ValueError says where."""
    if mine.shape != theirs.shape:
        raise ValueError(f"{mine.shape[0]} spans here, {theirs.shape[0]} on the other rank: the pools' "
                         "geometry or the sequences' lengths differ")
    out: List[List[int]] = []
    for i, (a, b) in enumerate(zip(mine.tolist(), theirs.tolist())):
        if a[2] != b[2]:
            raise ValueError(f"span {i} has {a[2]} bytes here and {b[2]} on the other rank: the pools' geometry differs")
        last = out[-1] if out else None
        if last and last[0] == a[0] and last[2] == b[0] and last[1] + last[4] == a[1] and last[3] + last[4] == b[1]:
            last[4] += a[2]
        else:
            out.append([a[0], a[1], b[0], b[1], a[2]])
    return [tuple(m) for m in out]


def transfer(pool: pagedkv.Pool, seqs, rank: int) -> int:
    """Moves the sequences' pages from rank 0's pool to rank 1's; returns the messages' count."""
    views = common.region_views(pool)
    mine = span_table(seqs)
    plan = messages(mine, exchange(mine, rank))
    if rank == PREFILL:
        works = [dist.isend(views[m[0]][m[1]:m[1] + m[4]], 1) for m in plan]
    else:
        works = [dist.irecv(views[m[0]][m[1]:m[1] + m[4]], 0) for m in plan]
    for w in works:
        w.wait()
    return len(plan)


def receive(pool: pagedkv.Pool, lens: List[int], rank: int) -> list:
    """Rank 1's side: sequences of the prompts' lengths, filled by the transfer; none kept if it fails."""
    seqs = [pool.alloc() for _ in lens]
    try:
        pool.append(seqs, lens)
        transfer(pool, seqs, rank)
    except BaseException:
        for s in seqs:
            s.free()
        raise
    return seqs


def same_bits(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


def bench(ctx: pagedkv.Context, args, rank: int, dev) -> bool:
    """One --bench-tokens sequence of 32 layers moved span by span, against one send of its bytes."""
    n = args.bench_tokens
    with pool_of(ctx, args, 32, n, 1, rank) as pool:
        (seq,) = [pool.alloc()]
        pool.append([seq], n)
        nbytes = int(span_table([seq])[:, 2].sum())
        peer_buffer = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        times = {}
        for what in ("spans", "one buffer") * 2:  # each twice: the first warms the connections
            dist.barrier()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if what == "spans":
                count = transfer(pool, [seq], rank)
            elif rank == PREFILL:
                dist.send(peer_buffer, 1)
            else:
                dist.recv(peer_buffer, 0)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times[what] = time.perf_counter() - t0
        if rank == DECODE:
            rate = {w: nbytes / t / 1e9 for w, t in times.items()}
            print(f"rank {rank}: transfer of {n} tokens x 32 layers ({args.format}, {nbytes / 1e6:.1f} MB) in "
                  f"{count} messages: {times['spans'] * 1e3:.2f} ms, {rate['spans']:.2f} GB/s; one buffer "
                  f"{times['one buffer'] * 1e3:.2f} ms, {rate['one buffer']:.2f} GB/s; ratio "
                  f"{rate['spans'] / rate['one buffer']:.3f}", flush=True)
        seq.free()
    return True


def main(rank: int, world: int, args) -> bool:
    if world != 2:
        raise SystemExit("disaggregated: two ranks, a prefill one and a decode one")
    dev = common.device(args)
    lens = lengths(args)
    ok = True
    with common.context(args) as ctx:
        pool = pool_of(ctx, args, args.layers, args.longest, args.prompts, rank)
        if rank == PREFILL:
            seqs = [pool.alloc() for _ in lens]
            common.prefill(pool, seqs, lens, args, dev)
            count = transfer(pool, seqs, rank)
            print(f"rank {rank}: sent {len(seqs)} sequences ({sum(lens)} tokens, {args.layers} layers, "
                  f"{args.format}) in {count} messages", flush=True)
        else:
            free_before = pool.stats().pages_free
            seqs = receive(pool, lens, rank)
            outs = common.decode_steps(pool, seqs, args, dev)
            with pool_of(ctx, args, args.layers, args.longest, args.prompts, 2) as ref:
                ref_seqs = [ref.alloc() for _ in lens]
                common.prefill(ref, ref_seqs, lens, args, dev)
                want = common.decode_steps(ref, ref_seqs, args, dev)
            ok &= common.report(rank, same_bits(outs, want), f"{args.steps} decode steps x {args.layers} layers "
                                f"of the transferred sequences equal, bit for bit, one pool's that prefilled itself")
            for s in seqs:
                s.free()
            ok &= common.report(rank, pool.stats().pages_free == free_before, "the decode pool's pages all free again")
        if args.bench_tokens:
            ok &= bench(ctx, args, rank, dev)
        pool.close()
    return ok


if __name__ == "__main__":
    p = common.options(__doc__.split("\n")[0])
    p.add_argument("--bench-tokens", type=int, default=0, help="time the transfer of one sequence of this many tokens")
    a = p.parse_args()
    print(f"disaggregated: --seed {a.seed} --backend {a.backend} --format {a.format}", flush=True)
    sys.exit(common.launch(main, a))
