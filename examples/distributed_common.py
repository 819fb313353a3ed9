"""What the distributed examples (disaggregated/, tensor_parallel/) share: their options, how they start
one process per rank, each rank's pagedkv context on its own device, the rows a model step would
compute (drawn from a seed, so every rank and every reference pool makes the same ones) and that
step (prefill, then decode steps) over a range of KV heads, and torch views over a pool's memory
that a collective library sends and receives into.

The engine's side is torch.distributed: NCCL between GPUs (backend cuda), gloo between host
processes (backend cpu, the pagedkv CPU backend, so the examples run where no GPU is). pagedkv
ships no transport: it says where a sequence's pages lie (Pool.regions, Sequence.page_spans) and
orders its work on the stream the engine gives its context, the stream torch's collectives wait on.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import socket
import sys
from pathlib import Path
from typing import Callable, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import pagedkv  # noqa: E402


def options(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--backend", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="pagedkv backend; torch.distributed then uses NCCL (cuda) or gloo (cpu)")
    p.add_argument("--format", default="f16", help="K and V page format (f16, bf16, q8_0, q4_0, fp8_e4m3, ...)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prompts", type=int, default=6, help="sequences in the batch")
    p.add_argument("--longest", type=int, default=300, help="the longest prompt, in tokens")
    p.add_argument("--steps", type=int, default=5, help="decode steps after the prefill")
    p.add_argument("--shuffle", action="store_true",
                   help="pools hand out pages in a shuffled order, as a long-running pool's free list would")
    p.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    p.add_argument("--world", type=int, default=2, help="ranks, when not started by torchrun")
    return p


def launch(main: Callable[[int, int, argparse.Namespace], bool], args: argparse.Namespace) -> int:
    """Runs main(rank, world, args) on every rank: the ranks torchrun started (RANK, WORLD_SIZE set),
    else args.world processes started here. Exits 0 when every rank's main returned True."""
    if "RANK" in os.environ:
        ok = _rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, main, args)
        return 0 if ok else 1
    with socket.socket() as s:  # a free port for the ranks to meet at
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(r, args.world, port, main, args)) for r in range(args.world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def _child(rank: int, world: int, port: int, main, args) -> None:
    sys.exit(0 if _rank(rank, world, port, main, args) else 1)


def _rank(rank: int, world: int, port, main, args) -> bool:
    init = f"tcp://127.0.0.1:{port}" if port else "env://"
    if args.backend == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.backend == "cuda" else "gloo", init_method=init, rank=rank,
                            world_size=world)
    try:
        return main(rank, world, args)
    finally:
        dist.destroy_process_group()


def device(args: argparse.Namespace) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if args.backend == "cuda" else torch.device("cpu")


def context(args: argparse.Namespace) -> pagedkv.Context:
    """This rank's context: on a GPU, on a stream of torch's made current for the rank's life, so
    that the library's writes, the collectives and its decodes run in the order the engine issues
    them (torch's default stream has handle 0, which a context reads as "the library's own")."""
    if args.backend == "cuda":
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)
        return pagedkv.Context(backend="cuda", device=torch.cuda.current_device(), stream=stream)
    return pagedkv.Context(backend="cpu", threads=1)


def page_order(args: argparse.Namespace, salt: int) -> int:
    """A pool's page_order_seed: 0 (pages in order) unless --shuffle, then one per pool (salt)."""
    return (hash((args.seed, salt)) & 0xFFFFFFFF) | 1 if args.shuffle else 0


def rows(args: argparse.Namespace, n: int, heads: int, *key: int) -> torch.Tensor:
    """n rows of `heads` heads (float16, [n, heads, head_dim]) for one key (what, sequence, layer,
    position...): the same values on every rank and in every pool."""
    g = torch.Generator().manual_seed(hash((args.seed,) + key) & 0x7FFFFFFFFFFFFFFF)
    return torch.randn(n, heads, args.head_dim, generator=g).to(torch.float16)


def prefill(pool: pagedkv.Pool, seqs, lens: List[int], args: argparse.Namespace, dev: torch.device,
            heads: slice = None) -> List[torch.Tensor]:
    """The prompts' K/V for every layer and the prefill's attention over them (Pool.extend), for the
    model's KV heads `heads` (all by default) and their query heads; each layer's attention output."""
    heads = heads or slice(0, args.kv_heads)
    qh = slice(heads.start * args.group, heads.stop * args.group)
    outs = []
    pool.append(seqs, lens)
    for layer in range(pool.layers):
        k, v, q = [torch.cat([rows(args, n, width, what, b, layer) for b, n in enumerate(lens)])[:, part]
                   for what, width, part in ((0, args.kv_heads, heads), (1, args.kv_heads, heads),
                                             (2, args.kv_heads * args.group, qh))]
        pool.write(layer, seqs, lens, k.contiguous().to(dev), v.contiguous().to(dev))
        outs.append(pool.extend(layer, seqs, lens, q.contiguous().to(dev)).clone())
    return outs


def decode_steps(pool: pagedkv.Pool, seqs, args: argparse.Namespace, dev: torch.device,
                 heads: slice = None) -> List[torch.Tensor]:
    """--steps decode steps over the KV heads `heads` (all by default): a new token's K/V for every
    layer, then its attention; every output."""
    heads = heads or slice(0, args.kv_heads)
    qh = slice(heads.start * args.group, heads.stop * args.group)
    outs = []
    for step in range(args.steps):
        pool.append(seqs, 1)
        for layer in range(pool.layers):
            k, v, q = [torch.cat([rows(args, 1, width, what, b, layer, step) for b in range(len(seqs))])[:, part]
                       for what, width, part in ((3, args.kv_heads, heads), (4, args.kv_heads, heads),
                                                 (5, args.kv_heads * args.group, qh))]
            pool.write(layer, seqs, 1, k.contiguous().to(dev), v.contiguous().to(dev))
            outs.append(pool.decode(layer, seqs, q.contiguous().to(dev)).clone())
    return outs


def region_views(pool: pagedkv.Pool) -> List[torch.Tensor]:
    """Each of the pool's memory regions as a uint8 tensor over the same memory (no copy): device
    memory on a GPU backend, host memory on the CPU backend."""
    views = []
    for r in pool.regions():
        if pool.ctx.backend == pagedkv.Backend.CPU:
            views.append(torch.frombuffer((ctypes.c_uint8 * r.bytes).from_address(r.address), dtype=torch.uint8))
        else:
            views.append(torch.as_tensor(_DeviceMemory(r.address, r.bytes), device="cuda"))
    return views


class _DeviceMemory:
    """Device memory that torch may view (the CUDA array interface)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3}


def report(rank: int, ok: bool, what: str) -> bool:
    print(f"rank {rank}: {'ok' if ok else 'FAIL'}: {what}", flush=True)
    return ok
