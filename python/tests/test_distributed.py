"""The page transfer of examples/disaggregated in one process, two pools (torch views over their
memory; skipped where torch is missing): a sequence moved span by span decodes as the original does,
on the CPU backend and, where there is one, on a CUDA GPU (device-to-device copies); a transfer that
fails half-way leaves the receiving pool as it was; pools of different geometry are refused."""
import sys
from pathlib import Path

import numpy as np
import pytest

import pagedkv

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "disaggregated"))
import disaggregated  # noqa: E402
import distributed_common as common  # noqa: E402


def backends():
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def fill(pool, rng, lengths, dev):
    seqs = [pool.alloc() for _ in lengths]
    pool.append(seqs, lengths)
    for layer in range(pool.layers):
        shape = (sum(lengths), pool.kv_heads, pool.head_dim)
        k, v = (torch.from_numpy(rng.standard_normal(shape).astype(np.float16)).to(dev) for _ in range(2))
        pool.write(layer, seqs, lengths, k, v)
    return seqs


def copy_spans(src_pool, src_seqs, dst_pool, dst_seqs, count=None):
    """What a transfer engine does: each span of the source's sequences into the same span of the
    destination's (the first `count` of them)."""
    src, dst = common.region_views(src_pool), common.region_views(dst_pool)
    plan = disaggregated.messages(disaggregated.span_table(src_seqs), disaggregated.span_table(dst_seqs))
    for m in plan[:count]:
        dst[m[2]][m[3]:m[3] + m[4]].copy_(src[m[0]][m[1]:m[1] + m[4]])
    return len(plan)


def pools(ctx, fmt, seed_a, seed_b, a_head_dim=64):
    """Two pools of one geometry (head_dim 64), but for the first's head_dim when a_head_dim says."""
    desc = dict(layers=2, kv_heads=2, head_dim=64, pages=96, page_size=8, max_sequences=6, k_format=fmt, v_format=fmt)
    return ctx.pool(page_order_seed=seed_a, **dict(desc, head_dim=a_head_dim)), ctx.pool(page_order_seed=seed_b, **desc)


def context(backend):
    """A context on the CPU, or on a stream of torch's made current (torch's default stream, handle 0,
    is the library's own stream to a context)."""
    if backend == "cuda":
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)
        return pagedkv.Context(backend="cuda", stream=stream)
    return pagedkv.Context(backend="cpu")


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_spans_move_sequences(rng, backend, fmt):
    dev = torch.device("cuda" if backend == "cuda" else "cpu")
    lengths = [int(x) for x in rng.integers(1, 60, 3)]
    with context(backend) as ctx:
        a, b = pools(ctx, fmt, int(rng.integers(1, 2**31)), int(rng.integers(1, 2**31)))
        src = fill(a, rng, lengths, dev)
        dst = [b.alloc() for _ in lengths]
        b.append(dst, lengths)
        copy_spans(a, src, b, dst)
        q = torch.from_numpy(rng.standard_normal((len(lengths), 4, 64)).astype(np.float16)).to(dev)
        for layer in range(a.layers):
            want, got = a.decode(layer, src, q), b.decode(layer, dst, q)
            assert torch.equal(want.view(torch.int16), got.view(torch.int16)), f"layer {layer}"
        a.close(), b.close()


def test_transfer_failing_half_way_changes_nothing(rng, monkeypatch):
    with context("cpu") as ctx:
        a, b = pools(ctx, "q8_0", 0, int(rng.integers(1, 2**31)))
        lengths = [int(x) for x in rng.integers(1, 60, 3)]
        src = fill(a, rng, lengths, "cpu")
        before = b.stats()

        def half_then_fail(pool, seqs, rank):
            done = copy_spans(a, src, pool, seqs, count=1)
            raise ConnectionError(f"the peer went away after 1 of {done} messages")

        monkeypatch.setattr(disaggregated, "transfer", half_then_fail)
        with pytest.raises(ConnectionError):
            disaggregated.receive(b, lengths, 1)
        assert b.stats() == before
        a.close(), b.close()


def test_geometry_mismatch_refused(rng):
    with context("cpu") as ctx:
        a, b = pools(ctx, "f16", 0, 0, a_head_dim=128)
        lengths = [int(x) for x in rng.integers(1, 60, 2)]
        src = fill(a, rng, lengths, "cpu")
        dst = [b.alloc() for _ in lengths]
        b.append(dst, lengths)
        with pytest.raises(ValueError, match="geometry"):
            copy_spans(a, src, b, dst)
        a.close(), b.close()
