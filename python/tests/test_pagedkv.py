"""The Python package against the library: results checked against a float64 reference computed here
with numpy from the values the pages hold, failures raised as the right exception with the library's
text, struct defaults compared with the header's PKV_*_INIT macros."""
import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pagedkv
from pagedkv import _ffi

HEADER = Path(__file__).resolve().parents[2] / "include" / "pagedkv.h"


def cpu_pool(ctx, **desc):
    base = dict(layers=2, kv_heads=2, head_dim=32, pages=64, page_size=4, max_sequences=8)
    base.update(desc)
    return ctx.pool(**base)


def stored(fmt, x):
    """What a page of format fmt holds for float32 values x."""
    x = np.asarray(x, np.float32)
    return x if fmt == pagedkv.Format.F32 else x.astype(np.float16).astype(np.float32)


def reference(q, keys, values, q_tokens, scale):
    """float64 attention of q [q_tokens, q_heads, d] over keys/values [n, kv_heads, d], causal over the
    newest q_tokens positions; returns out [q_tokens, q_heads, d] and lse [q_tokens, q_heads]."""
    n, kv_heads, _ = keys.shape
    q_heads = q.shape[1]
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for t in range(q_tokens):
        visible = n - q_tokens + t + 1
        for h in range(q_heads):
            kh = h // (q_heads // kv_heads)
            logits = scale * (keys[:visible, kh].astype(np.float64) @ q[t, h].astype(np.float64))
            m = logits.max()
            w = np.exp(logits - m)
            out[t, h] = w @ values[:visible, kh].astype(np.float64) / w.sum()
            lse[t, h] = m + np.log(w.sum())
    return out, lse


def test_version():
    assert pagedkv.__version__ == pagedkv.library_version()
    text = HEADER.read_text()
    parts = [re.search(rf"#define PKV_VERSION_{p} (\d+)", text).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
    assert pagedkv.__version__ == ".".join(parts)


def _init_values(text, macro):
    body = re.search(rf"#define {macro}\s*\\?\s*\{{(.*?)\}}\s*\n(?!\s)", text, re.S).group(1)
    body = body.replace("\\\n", " ")
    values, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            values.append(cur.strip())
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    values.append(cur.strip())
    return values


@pytest.mark.parametrize("cls,macro", [
    (_ffi.ContextDesc, "PKV_CONTEXT_DESC_INIT"), (_ffi.BackendInfo, "PKV_BACKEND_INFO_INIT"),
    (_ffi.PoolDesc, "PKV_POOL_DESC_INIT"), (_ffi.WriteArgs, "PKV_WRITE_ARGS_INIT"),
    (_ffi.ReadArgs, "PKV_READ_ARGS_INIT"), (_ffi.DecodeArgs, "PKV_DECODE_ARGS_INIT"),
    (_ffi.PoolStats, "PKV_POOL_STATS_INIT"), (_ffi.ExportArgs, "PKV_EXPORT_ARGS_INIT"),
    (_ffi.ImportArgs, "PKV_IMPORT_ARGS_INIT"), (_ffi.ExtendArgs, "PKV_EXTEND_ARGS_INIT"),
    (_ffi.ScalesArgs, "PKV_SCALES_ARGS_INIT")])
def test_defaults_match_header(cls, macro):
    values = _init_values(HEADER.read_text(), macro)
    made = _ffi.new_struct(cls)
    assert len(values) == len(cls._fields_), f"{macro} has {len(values)} values, {cls.__name__} {len(cls._fields_)} fields"
    enums = {f"PKV_{k.__name__.upper()}_{m.name}": m.value for k in (pagedkv.Backend, pagedkv.Format, pagedkv.Memory)
             for m in k}
    for (name, _), text in zip(cls._fields_, values):
        got = getattr(made, name)
        if name == "struct_size":
            assert got == ctypes.sizeof(cls)
        elif text in enums:
            assert got == enums[text], (macro, name)
        elif text in ("NULL", "{ 0 }"):
            raw = bytes(got) if isinstance(got, ctypes.Structure) else got
            assert not (raw.strip(b"\0") if isinstance(raw, bytes) else raw), (macro, name)
        else:
            assert float(got) == float(text.rstrip("f")), (macro, name, got, text)


def test_zero_filled_struct_refused():
    """The library refuses struct_size 0: why every binding sets it (new_struct does)."""
    lib = _ffi.lib()
    ctx = ctypes.c_void_p()
    assert lib.pkv_context_create(ctypes.byref(_ffi.ContextDesc()), ctypes.byref(ctx)) == pagedkv.Status.ERR_STRUCT_SIZE
    assert "PKV_CONTEXT_DESC_INIT" in lib.pkv_last_error().decode()


@pytest.mark.parametrize("q_tokens", [1, 3, 8])
def test_decode_matches_float64_reference(rng, q_tokens):
    kv_heads, group, head_dim = int(rng.integers(1, 4)), int(rng.choice([1, 2, 4])), int(rng.choice([32, 64]))
    q_heads = kv_heads * group
    k_format, v_format = (pagedkv.Format(int(x)) for x in rng.choice([1, 2], 2))
    io = rng.choice([np.float32, np.float16])
    with pagedkv.Context(backend="cpu", threads=2) as ctx, \
            cpu_pool(ctx, kv_heads=kv_heads, head_dim=head_dim, k_format=k_format, v_format=v_format,
                     page_order_seed=int(rng.integers(1, 1000))) as pool:
        lengths = [int(x) for x in rng.integers(q_tokens, 40, 4)]
        seqs = [pool.alloc() for _ in lengths]
        pool.append(seqs, lengths)
        k = rng.uniform(-1, 1, (sum(lengths), kv_heads, head_dim)).astype(np.float32)
        v = rng.uniform(-1, 1, k.shape).astype(np.float32)
        pool.write(1, seqs, lengths, k, v)
        assert [len(s) for s in seqs] == lengths
        q = rng.uniform(-2, 2, (len(seqs), q_tokens, q_heads, head_dim)).astype(io)
        out, lse = pool.decode(1, seqs, q, lse=True)
        assert out.dtype == io and out.shape == q.shape and lse.shape == q.shape[:-1]
        first = 0
        for b, n in enumerate(lengths):
            ref, ref_lse = reference(q[b], stored(k_format, k[first:first + n]), stored(v_format, v[first:first + n]),
                                     q_tokens, 1 / np.sqrt(head_dim))
            tol = 2e-3 if io == np.float16 else 1e-5
            err = np.linalg.norm(out[b].astype(np.float64) - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
            assert err.max() < tol, (b, err.max())
            np.testing.assert_allclose(lse[b], ref_lse, atol=1e-4)
            first += n
        # the pages give back what was written, as the page format stores it
        got_k, got_v = pool.read(1, seqs[0])
        np.testing.assert_array_equal(got_k, stored(k_format, k[:lengths[0]]))
        np.testing.assert_array_equal(got_v, stored(v_format, v[:lengths[0]]))


def attend_seen(q, keys, values, seen, scale):
    """float64 attention of one query row q [q_heads, d] over the positions of keys/values [n, kv_heads, d]
    that the boolean seen [n] marks; returns out [q_heads, d] and lse [q_heads]."""
    kv_heads, q_heads = keys.shape[1], q.shape[0]
    out, lse = np.zeros(q.shape), np.zeros(q_heads)
    for h in range(q_heads):
        kh = h // (q_heads // kv_heads)
        logits = scale * (keys[seen, kh].astype(np.float64) @ q[h].astype(np.float64))
        m = logits.max()
        w = np.exp(logits - m)
        out[h] = w @ values[seen, kh].astype(np.float64) / w.sum()
        lse[h] = m + np.log(w.sum())
    return out, lse


def tree_mask(rng, n):
    """Each new token sees itself and its parent's ancestors (a random earlier token, or none)."""
    m = np.zeros((n, n), bool)
    for i in range(n):
        if i and rng.integers(4):
            m[i] = m[rng.integers(i)]
        m[i, i] = True
    return m


@pytest.mark.parametrize("masked", [False, True])
def test_extend_matches_float64_reference(rng, masked):
    """A ragged batch (a sequence with no new tokens, one from empty) in chunks over the growing cache."""
    kv_heads, group, head_dim = int(rng.integers(1, 4)), int(rng.choice([1, 3, 4])), int(rng.choice([32, 64]))
    q_heads = kv_heads * group
    k_format, v_format = (pagedkv.Format(int(x)) for x in rng.choice([1, 2], 2))
    io = rng.choice([np.float32, np.float16])
    with pagedkv.Context(backend="cpu", threads=2) as ctx, \
            cpu_pool(ctx, kv_heads=kv_heads, head_dim=head_dim, k_format=k_format, v_format=v_format, pages=256,
                     page_order_seed=int(rng.integers(1, 1000))) as pool:
        seqs = [pool.alloc() for _ in range(4)]
        keys = [np.zeros((0, kv_heads, head_dim), np.float32) for _ in seqs]
        values = [np.zeros((0, kv_heads, head_dim), np.float32) for _ in seqs]
        for _ in range(3):
            tokens = [int(x) for x in rng.integers(0, 30, len(seqs))]
            tokens[1] = 0
            pool.append(seqs, tokens)
            k = rng.uniform(-1, 1, (sum(tokens), kv_heads, head_dim)).astype(np.float32)
            v = rng.uniform(-1, 1, k.shape).astype(np.float32)
            pool.write(1, seqs, tokens, k, v)
            first = 0
            for b, n in enumerate(tokens):
                keys[b] = np.concatenate([keys[b], stored(k_format, k[first:first + n])])
                values[b] = np.concatenate([values[b], stored(v_format, v[first:first + n])])
                first += n
            q = rng.uniform(-2, 2, (sum(tokens), q_heads, head_dim)).astype(io)
            masks = [tree_mask(rng, n) for n in tokens] if masked else None
            out, lse = pool.extend(1, seqs, tokens, q, lse=True, masks=masks)
            assert out.dtype == io and out.shape == q.shape and lse.shape == q.shape[:-1]
            row = 0
            for b, n in enumerate(tokens):
                length = len(keys[b])
                for i in range(n):
                    seen = np.arange(length) <= length - n + i
                    if masked:
                        seen[length - n:] = masks[b][i]
                    ref, ref_lse = attend_seen(q[row], keys[b], values[b], seen, 1 / np.sqrt(head_dim))
                    tol = 2e-3 if io == np.float16 else 1e-5
                    err = np.linalg.norm(out[row].astype(np.float64) - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
                    assert err.max() < tol, (b, i, err.max())
                    np.testing.assert_allclose(lse[row], ref_lse, atol=1e-4)
                    row += 1


def test_extend_gives_decodes_bits(rng):
    """Up to 8 new tokens: pkv_decode with those query tokens, unsplit, computes the same sums."""
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx) as pool:
        seqs = [pool.alloc() for _ in range(3)]
        pool.append(seqs, [9, 30, 17])
        pool.write(0, seqs, [9, 30, 17], rng.standard_normal((56, 2, 32)), rng.standard_normal((56, 2, 32)))
        q = rng.standard_normal((3, 5, 4, 32)).astype(np.float32)
        out = pool.extend(0, seqs, [5, 5, 5], q.reshape(15, 4, 32))
        np.testing.assert_array_equal(out.reshape(q.shape), pool.decode(0, seqs, q, chunk_pages=2**32 - 1))


def test_prepare_attends_nothing(rng):
    """prepare=True (pkv_decode_prepare, pkv_extend_prepare) returns None, leaves out as it was, checks
    what the call checks, and the call that follows gives the bits it gives without it."""
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx) as pool:
        seqs = [pool.alloc() for _ in range(2)]
        pool.append(seqs, [20, 11])
        pool.write(0, seqs, [20, 11], rng.standard_normal((31, 2, 32)), rng.standard_normal((31, 2, 32)))
        q = rng.standard_normal((7, 4, 32)).astype(np.float32)
        direct = pool.extend(0, seqs, [4, 3], q)
        out = np.full_like(q, np.nan)
        assert pool.extend(0, seqs, [4, 3], q, out=out, prepare=True) is None
        assert np.isnan(out).all()
        np.testing.assert_array_equal(pool.extend(0, seqs, [4, 3], q, out=out), direct)
        with pytest.raises(pagedkv.InvalidArgumentError, match="fewer than its 12 queries"):
            pool.extend(0, seqs, [4, 12], np.zeros((16, 4, 32), np.float32), prepare=True)
        qd = rng.standard_normal((2, 4, 32)).astype(np.float32)
        direct = pool.decode(0, seqs, qd)
        out = np.full_like(qd, np.nan)
        assert pool.decode(0, seqs, qd, out=out, prepare=True) is None
        assert np.isnan(out).all()
        np.testing.assert_array_equal(pool.decode(0, seqs, qd, out=out), direct)


def test_extend_refuses_bad_input(rng):
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx) as pool:
        s = pool.alloc()
        pool.append([s], [3])
        pool.write(0, [s], [3], rng.standard_normal((3, 2, 32)), rng.standard_normal((3, 2, 32)))
        with pytest.raises(pagedkv.InvalidArgumentError, match="fewer than its 4 queries"):
            pool.extend(0, [s], [4], np.zeros((4, 2, 32), np.float32))
        with pytest.raises(pagedkv.InvalidArgumentError, match="sees itself"):
            pool.extend(0, [s], [2], np.zeros((2, 2, 32), np.float32), masks=[np.array([[1, 0], [1, 0]])])
        with pytest.raises(ValueError, match="expected its sequence's"):
            pool.extend(0, [s], [2], np.zeros((2, 2, 32), np.float32), masks=[np.ones((3, 3))])
        with pytest.raises(ValueError, match="sum"):
            pool.extend(0, [s], [2], np.zeros((3, 2, 32), np.float32))


def test_a_sequence_twice_in_one_decode(rng):
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx) as pool:
        s = pool.alloc()
        pool.append([s], [5])
        pool.write(0, [s], [5], rng.standard_normal((5, 2, 32)), rng.standard_normal((5, 2, 32)))
        q = rng.standard_normal((2, 2, 32)).astype(np.float32)
        both = pool.decode(0, [s, s], q)
        np.testing.assert_array_equal(both[1], pool.decode(0, [s], q[1:])[0])
        with pytest.raises(pagedkv.InvalidArgumentError, match="same sequence"):
            pool.append([s, s], [1, 1])


def test_errors_carry_status_and_detail():
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx, pages=2, page_size=4) as pool:
        s = pool.alloc()
        s.free()
        with pytest.raises(pagedkv.StaleHandleError) as e:
            s.free()
        assert e.value.status == pagedkv.Status.ERR_STALE_HANDLE and e.value.function == "pkv_seq_free"
        assert e.value.detail.startswith("PKV_ERR_STALE_HANDLE: pkv_seq_free: ")
        t, u = pool.alloc(), pool.alloc()
        with pytest.raises(pagedkv.OutOfPagesError, match="nothing was appended"):
            pool.append([t, u], [8, 1])
        assert len(t) == len(u) == 0
        with pytest.raises(pagedkv.InvalidArgumentError, match="head_dim"):
            ctx.pool(layers=1, kv_heads=1, head_dim=33, pages=1)
        with pytest.raises(TypeError, match="unknown pool field"):
            ctx.pool(layers=1, kv_heads=1, head_dim=32, pages=1, heads=1)
        with pytest.raises(ValueError, match="expected one of"):
            ctx.pool(layers=1, kv_heads=1, head_dim=32, pages=1, k_format="f8")
        with pytest.raises(ValueError, match="k has shape"):
            pool.write(0, [t], [0], np.zeros((1, 2, 32)), np.zeros((1, 2, 32)))
        with pytest.raises(ValueError, match="open pool"):
            ctx.close()


def attend_variants(q, keys, values, query, seen, scale, window, softcap, sinks, slopes):
    """attend_seen for the query at position `query` with the attention variants (pagedkv.h, 7a):
    scale, soft-cap, ALiBi, the window, then the sink in the denominator."""
    kv_heads, q_heads = keys.shape[1], q.shape[0]
    positions = np.arange(len(seen))
    seen = seen & ~((window > 0) & (positions <= query - window))
    out, lse = np.zeros(q.shape), np.zeros(q_heads)
    for h in range(q_heads):
        kh = h // (q_heads // kv_heads)
        logits = scale * (keys[seen, kh].astype(np.float64) @ q[h].astype(np.float64))
        if softcap:
            logits = softcap * np.tanh(logits / softcap)
        if slopes is not None:
            logits -= slopes[h] * (query - positions[seen])
        m = max(logits.max(), sinks[h] if sinks is not None else -np.inf)
        w = np.exp(logits - m)
        z = w.sum() + (np.exp(sinks[h] - m) if sinks is not None else 0.0)
        out[h] = w @ values[seen, kh].astype(np.float64) / z
        lse[h] = m + np.log(z)
    return out, lse


@pytest.mark.parametrize("call", ["decode", "extend"])
def test_variants_match_float64_reference(rng, call):
    """Window, soft-cap, sinks and ALiBi together, split into many chunks."""
    kv_heads, group, head_dim, n, t = 2, 2, 32, 45, 5
    q_heads = kv_heads * group
    window, softcap = int(rng.integers(1, 20)), float(rng.uniform(1, 10))
    sinks = rng.uniform(-2, 2, q_heads).astype(np.float32)
    slopes = rng.uniform(0, 0.3, q_heads).astype(np.float32)
    with pagedkv.Context(backend="cpu", threads=2) as ctx, \
            cpu_pool(ctx, kv_heads=kv_heads, head_dim=head_dim, k_format=pagedkv.Format.F32,
                     v_format=pagedkv.Format.F32) as pool, pool.alloc() as seq:
        pool.append([seq], [n])
        k = rng.uniform(-1, 1, (n, kv_heads, head_dim)).astype(np.float32)
        v = rng.uniform(-1, 1, k.shape).astype(np.float32)
        pool.write(0, [seq], [n], k, v)
        variants = dict(window=window, softcap=softcap, sinks=sinks, alibi_slopes=slopes)
        if call == "decode":
            q = rng.uniform(-2, 2, (1, t, q_heads, head_dim)).astype(np.float32)
            out, lse = pool.decode(0, [seq], q, lse=True, chunk_pages=1, **variants)
            out, lse, q = out[0], lse[0], q[0]
        else:
            q = rng.uniform(-2, 2, (t, q_heads, head_dim)).astype(np.float32)
            out, lse = pool.extend(0, [seq], [t], q, lse=True, **variants)
        for i in range(t):
            query = n - t + i
            ref, ref_lse = attend_variants(q[i], k, v, query, np.arange(n) <= query, 1 / np.sqrt(head_dim), window,
                                           softcap, sinks.astype(np.float64), slopes.astype(np.float64))
            err = np.linalg.norm(out[i] - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
            assert err.max() < 1e-5, (i, err.max())
            np.testing.assert_allclose(lse[i], ref_lse, atol=1e-5)
        with pytest.raises(ValueError, match="one value per query head"):
            pool.decode(0, [seq], np.zeros((1, q_heads, head_dim), np.float32), sinks=sinks[:1])
        with pytest.raises(pagedkv.InvalidArgumentError, match="softcap"):
            pool.decode(0, [seq], np.zeros((1, q_heads, head_dim), np.float32), softcap=-1.0)


def test_release_before(rng):
    """Pages before a window go back; the windowed decode still runs; what needs them is refused."""
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx, page_size=4, pages=16) as pool, pool.alloc() as seq:
        pool.append([seq], [30])
        pool.write(0, [seq], [30], rng.standard_normal((30, 2, 32)), rng.standard_normal((30, 2, 32)))
        q = rng.standard_normal((1, 2, 32)).astype(np.float32)
        before = pool.decode(0, [seq], q, window=8)
        free = pool.stats().pages_free
        seq.release_before(22)  # positions 22..29 are the window of the query at 29
        assert pool.stats().pages_free == free + 5 and len(seq) == 30
        np.testing.assert_array_equal(pool.decode(0, [seq], q, window=8), before)
        with pytest.raises(pagedkv.InvalidArgumentError, match="position 0"):
            pool.decode(0, [seq], q)
        with pytest.raises(pagedkv.InvalidArgumentError, match="position 21"):
            pool.read(0, seq, 21, 2)
        with pytest.raises(pagedkv.InvalidArgumentError, match="past the sequence's length"):
            seq.release_before(31)


def fp8_values(fmt):
    """The values of the 128 non-negative codes of an OCP FP8 format, from the bit fields (NaN where
    the code is NaN or infinite)."""
    mbits, bias = (3, 7) if fmt == pagedkv.Format.FP8_E4M3 else (2, 15)
    codes = np.arange(128)
    e, m = codes >> mbits, codes & ((1 << mbits) - 1)
    values = np.where(e == 0, np.ldexp(m.astype(np.float64), 1 - bias - mbits),
                      np.ldexp(1.0 + m / (1 << mbits), e - bias))
    special = (e == 15) & (m == 7) if fmt == pagedkv.Format.FP8_E4M3 else e == 31
    return np.where(special, np.nan, values)


def fp8_stored(fmt, x, scale):
    """What an FP8 page holds for x under scale: the nearest finite code's value of x / scale (ties to
    the even code, past the largest value that one), times scale, in float32."""
    values = fp8_values(fmt)
    finite = values[np.isfinite(values)]
    a = np.abs((np.asarray(x, np.float32) / np.float32(scale)).astype(np.float64))
    gap = np.abs(a[..., None] - finite)
    best = gap.min(axis=-1, keepdims=True)
    ties = (gap == best) & (np.arange(len(finite)) % 2 == 0)
    pick = np.where(ties.any(axis=-1), ties.argmax(axis=-1), gap.argmin(axis=-1))
    v = np.where(a >= finite[-1], finite[-1], finite[pick])
    return (np.copysign(v, x).astype(np.float32) * np.float32(scale)).astype(np.float32)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pages_with_scales(rng, fmt):
    """FP8 K and V pages with per-head K scales and per-layer V scales: rows read back as the nearest
    code times the scale, decode agrees with the float64 reference over those values, the scales read
    back as set, and scales for F16 pages are refused."""
    f = pagedkv.Format[fmt.upper()]
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx, k_format=fmt, v_format=fmt) as pool, \
            pool.alloc() as seq:
        k_scales = rng.uniform(0.01, 4.0, (2, 2)).astype(np.float32)
        v_scales = rng.uniform(0.01, 4.0, 2).astype(np.float32)
        pool.set_scales(k=k_scales)
        pool.set_scales(v=v_scales)
        got_k, got_v = pool.scales()
        np.testing.assert_array_equal(np.array(got_k, np.float32), k_scales)
        np.testing.assert_array_equal(np.array(got_v, np.float32), np.repeat(v_scales[:, None], 2, axis=1))
        n = 37
        k = (rng.standard_normal((n, 2, 32)) * 3).astype(np.float32)
        v = (rng.standard_normal((n, 2, 32)) * 3).astype(np.float32)
        pool.append([seq], [n])
        pool.write(1, [seq], [n], k, v)
        want_k = np.stack([fp8_stored(f, k[:, h], k_scales[1, h]) for h in range(2)], axis=1)
        want_v = fp8_stored(f, v, v_scales[1])
        rk, rv = pool.read(1, seq)
        np.testing.assert_array_equal(rk, want_k)
        np.testing.assert_array_equal(rv, want_v)
        q = rng.standard_normal((1, 4, 32)).astype(np.float32)
        out, lse = pool.decode(1, [seq], q, lse=True)
        ref, ref_lse = reference(q, want_k, want_v, 1, 1 / np.sqrt(32))
        np.testing.assert_allclose(out[0], ref[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse[0], ref_lse[0], atol=1e-4)
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx) as pool:
        with pytest.raises(pagedkv.InvalidArgumentError, match="only FP8 pages have scales"):
            pool.set_scales(k=[1.0, 1.0])


def test_fork_truncate_and_context_managers(rng):
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx, page_size=4, pages=16) as pool:
        with pool.alloc() as parent:
            pool.append([parent], [10])
            pool.write(0, [parent], [10], rng.standard_normal((10, 2, 32)), rng.standard_normal((10, 2, 32)))
            with parent.fork() as child:
                assert len(child) == 10 and pool.stats().pages_shared == 3
                child.truncate(4)
                assert len(child) == 4 and len(parent) == 10
                np.testing.assert_array_equal(pool.read(0, child)[0], pool.read(0, parent, 0, 4)[0])
            assert pool.stats().sequences_live == 1
        stats = pool.stats()
        assert stats.sequences_live == 0 and stats.pages_free == stats.pages_total == 16
    with pytest.raises(ValueError, match="closed"):
        pool.alloc()


def test_library_not_found_says_how_to_point_at_it(tmp_path):
    env = dict(os.environ, PAGEDKV_LIBRARY=str(tmp_path / "libpagedkv.so"))
    code = "import pagedkv\ntry:\n    pagedkv.library_version()\nexcept ImportError as e:\n    print(e)\n"
    text = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "PAGEDKV_LIBRARY" in text and "libpagedkv.so" in text


def test_collected_context_closes_its_pools_and_itself():
    ctx = pagedkv.Context("cpu")
    pool = ctx.pool(layers=1, kv_heads=1, head_dim=32, pages=4)
    ctx.__del__()  # what the collector does with a context and pool that only refer to each other
    assert not pool._ptr and not ctx._ptr


def test_backends_lists_the_cpu():
    cpu = [b for b in pagedkv.backends() if b.backend == pagedkv.Backend.CPU][0]
    assert cpu.compiled and cpu.device_count == 1


def test_torch_host_tensors(rng):
    torch = pytest.importorskip("torch")
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx) as pool:
        s = pool.alloc()
        pool.append([s], [6])
        k = torch.from_numpy(rng.standard_normal((6, 2, 32)).astype(np.float32))
        pool.write(0, [s], [6], k, k.clone())
        q = torch.from_numpy(rng.standard_normal((1, 4, 32)).astype(np.float32))
        out = pool.decode(0, [s], q)
        assert isinstance(out, torch.Tensor)
        np.testing.assert_array_equal(out.numpy(), pool.decode(0, [s], q.numpy()))


def _filled(pool, rng, lengths):
    seqs = [pool.alloc() for _ in lengths]
    pool.append(seqs, lengths)
    for layer in range(pool.layers):
        for s, n in zip(seqs, lengths):
            shape = (n, pool.kv_heads, pool.head_dim)
            pool.write(layer, [s], [n], rng.standard_normal(shape), rng.standard_normal(shape))
    return seqs


@pytest.mark.parametrize("k_format,v_format", [("f16", "q4_0"), ("q8_0", "bf16"), ("f32", "f32")])
def test_export_import_round_trip(rng, k_format, v_format):
    """An image imported into a second pool reads back and decodes the same bits; its re-export is the
    same bytes."""
    with pagedkv.Context(backend="cpu") as ctx, \
            cpu_pool(ctx, k_format=k_format, v_format=v_format, page_order_seed=3) as a, \
            cpu_pool(ctx, k_format=k_format, v_format=v_format, page_order_seed=9) as b:
        seqs = _filled(a, rng, [int(rng.integers(1, 30)), int(rng.integers(1, 30))])
        for s in seqs:
            image = a.export_seq(s)
            assert image.dtype == np.uint8 and image.nbytes == a.export_size(s)
            t = b.import_seq(bytes(image))
            assert len(t) == len(s)
            for layer in range(a.layers):
                for x, y in zip(a.read(layer, s), b.read(layer, t)):
                    np.testing.assert_array_equal(x, y)
            assert bytes(b.export_seq(t)) == bytes(image)
            q = rng.standard_normal((1, 4, 32)).astype(np.float32)
            np.testing.assert_array_equal(a.decode(1, [s], q), b.decode(1, [t], q))


def test_swap_out_and_in(rng):
    """export + free, then import: the pages come back, under a new handle, and the old one is stale."""
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx) as pool:
        (s,) = _filled(pool, rng, [13])
        before = pool.read(1, s)
        free = pool.stats().pages_free
        image = np.empty(pool.export_size(s), np.uint8)
        pool.export_seq(s, out=image)
        s.free()
        assert pool.stats().pages_free == free + 4
        t = pool.import_seq(image)
        assert pool.stats().pages_free == free
        for x, y in zip(before, pool.read(1, t)):
            np.testing.assert_array_equal(x, y)
        with pytest.raises(pagedkv.StaleHandleError):
            len(s)
        part = pool.export_seq(t, first_layer=1, layer_count=1)
        assert part.nbytes - 128 == (image.nbytes - 128) // 2


def test_bad_images_change_nothing(rng):
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx) as pool, cpu_pool(ctx, head_dim=64) as other:
        (s,) = _filled(pool, rng, [9])
        image = pool.export_seq(s)
        stats = pool.stats()
        corrupt = image.copy()
        corrupt[-1] ^= 1
        with pytest.raises(pagedkv.InvalidArgumentError, match="payload is corrupted"):
            pool.import_seq(corrupt)
        with pytest.raises(pagedkv.InvalidArgumentError, match="truncated"):
            pool.import_seq(image[:-64])
        future = image.copy()
        future[8] = 2
        with pytest.raises(pagedkv.VersionError, match="version 2"):
            pool.import_seq(future)
        with pytest.raises(pagedkv.InvalidArgumentError, match="head_dim is 32, the pool's 64"):
            other.import_seq(image)
        assert pool.stats() == stats
        with pytest.raises(pagedkv.InvalidArgumentError, match="image_bytes is 16"):
            pool.export_seq(s, out=np.empty(16, np.uint8))
        with pytest.raises(ValueError, match="not a Sequence of this pool"):
            other.export_seq(s)


def test_regions_and_page_spans(rng):
    with pagedkv.Context(backend="cpu") as ctx, cpu_pool(ctx) as pool:
        (s,) = _filled(pool, rng, [10])
        (region,) = pool.regions()
        assert region.bytes == pool.stats().bytes_total
        spans = s.page_spans()
        assert len(spans) == 2 * pool.layers * 3
        assert [(x.layer, x.index, x.part) for x in spans[:4]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
        image = pool.export_seq(s)
        # the CPU backend's region is host memory: the spans hold the image's payload, in order
        payload = b"".join(ctypes.string_at(region.address + x.offset, x.bytes) for x in spans)
        assert payload == bytes(image[128:])
        assert s.page_spans(first_layer=1) == spans[len(spans) // 2:]
