#!/usr/bin/env python3
"""pagedkv from Python through ctypes, standard library only: the structs are declared here as an FFI
binding would declare them, a CPU pool gets K/V rows and decodes, and the result is checked against a
float64 reference written in plain Python. Failures must reach Python as a status and a last-error text.

Usage: test_ffi.py PATH-TO-libpagedkv.so   (PKV_TEST_SEED replays a run)
"""
import ctypes
import math
import os
import random
import struct
import sys
import threading
import unittest

U32, I32, U64, F32 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_float
ENUM = ctypes.c_int32  # every pagedkv enum is 32-bit

PKV_OK, PKV_ERR_INVALID_ARGUMENT, PKV_ERR_STRUCT_SIZE, PKV_ERR_STALE_HANDLE = 0, 1, 2, 3
PKV_ERR_VERSION = 10
PKV_BACKEND_CPU = 1
PKV_FORMAT_F32, PKV_FORMAT_F16 = 1, 2
PKV_MEMORY_HOST = 0


class Seq(ctypes.Structure):
    _fields_ = [("id", U64)]


class ContextDesc(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("backend", ENUM), ("device", I32), ("threads", U32),
                ("stream", ctypes.c_void_p)]


class PoolDesc(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("layers", U32), ("kv_heads", U32), ("head_dim", U32),
                ("page_size", U32), ("pages", U32), ("max_sequences", U32), ("k_format", ENUM),
                ("v_format", ENUM), ("page_order_seed", U32), ("max_sequence_length", U32)]


class WriteArgs(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("layer", U32), ("seqs", ctypes.POINTER(Seq)),
                ("n_tokens", ctypes.POINTER(U32)), ("count", U32), ("src_format", ENUM), ("memory", ENUM),
                ("k", ctypes.c_void_p), ("v", ctypes.c_void_p)]


class DecodeArgs(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("layer", U32), ("seqs", ctypes.POINTER(Seq)), ("count", U32),
                ("q_heads", U32), ("q_tokens", U32), ("scale", F32), ("q_format", ENUM), ("out_format", ENUM),
                ("memory", ENUM), ("q", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("lse", ctypes.POINTER(F32)), ("chunk_pages", U32)]


class Api(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("api_version", U32)]


def sized(cls, **fields):
    """A struct with struct_size set, as the header's PKV_*_INIT macros do."""
    return cls(struct_size=ctypes.sizeof(cls), **fields)


def load(path):
    lib = ctypes.CDLL(path)
    status = ENUM
    signatures = {
        "pkv_status_string": (ctypes.c_char_p, [status]),
        "pkv_last_error": (ctypes.c_char_p, []),
        "pkv_context_create": (status, [ctypes.POINTER(ContextDesc), ctypes.POINTER(ctypes.c_void_p)]),
        "pkv_context_destroy": (status, [ctypes.c_void_p]),
        "pkv_pool_create": (status, [ctypes.c_void_p, ctypes.POINTER(PoolDesc), ctypes.POINTER(ctypes.c_void_p)]),
        "pkv_pool_destroy": (status, [ctypes.c_void_p]),
        "pkv_seq_alloc": (status, [ctypes.c_void_p, ctypes.POINTER(Seq)]),
        "pkv_seq_free": (status, [ctypes.c_void_p, Seq]),
        "pkv_seq_length": (status, [ctypes.c_void_p, Seq, ctypes.POINTER(U32)]),
        "pkv_append": (status, [ctypes.c_void_p, ctypes.POINTER(Seq), ctypes.POINTER(U32), U32]),
        "pkv_write": (status, [ctypes.c_void_p, ctypes.POINTER(WriteArgs)]),
        "pkv_decode": (status, [ctypes.c_void_p, ctypes.POINTER(DecodeArgs)]),
        "pkv_get_api": (status, [U32, ctypes.POINTER(ctypes.POINTER(Api))]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def as_f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def as_f16(x):
    return struct.unpack("e", struct.pack("e", x))[0]


class Ffi(unittest.TestCase):
    lib = None
    rng = None

    def check(self, status):
        self.assertEqual(status, PKV_OK, self.lib.pkv_last_error().decode())

    def open_pool(self, kv_heads, head_dim, k_format, v_format):
        ctx, pool = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.pkv_context_create(sized(ContextDesc, backend=PKV_BACKEND_CPU), ctypes.byref(ctx)))
        self.addCleanup(lambda: self.check(self.lib.pkv_context_destroy(ctx)))
        desc = sized(PoolDesc, layers=2, kv_heads=kv_heads, head_dim=head_dim, page_size=8, pages=32,
                     max_sequences=8, k_format=k_format, v_format=v_format,
                     page_order_seed=self.rng.randrange(1, 1000))
        self.check(self.lib.pkv_pool_create(ctx, ctypes.byref(desc), ctypes.byref(pool)))
        self.addCleanup(lambda: self.check(self.lib.pkv_pool_destroy(pool)))
        return pool

    def test_round_trip(self):
        rng = self.rng
        kv_heads, group, head_dim = rng.randrange(1, 3), rng.randrange(1, 4), 32 * rng.randrange(1, 3)
        q_heads, row = kv_heads * group, kv_heads * head_dim
        k_format = rng.choice([PKV_FORMAT_F32, PKV_FORMAT_F16])
        v_format = rng.choice([PKV_FORMAT_F32, PKV_FORMAT_F16])
        stored = {PKV_FORMAT_F32: as_f32, PKV_FORMAT_F16: lambda x: as_f16(as_f32(x))}
        pool = self.open_pool(kv_heads, head_dim, k_format, v_format)
        layer = 1

        seqs = (Seq * 3)()
        for s in seqs:
            self.check(self.lib.pkv_seq_alloc(pool, ctypes.byref(s)))
        lengths = [rng.randrange(1, 30) for _ in seqs]
        self.check(self.lib.pkv_append(pool, seqs, (U32 * 3)(*lengths), 3))
        total = sum(lengths)
        k = [rng.uniform(-1, 1) for _ in range(total * row)]
        v = [rng.uniform(-1, 1) for _ in range(total * row)]
        k_buf, v_buf = (F32 * len(k))(*k), (F32 * len(v))(*v)
        args = sized(WriteArgs, layer=layer, seqs=seqs, n_tokens=(U32 * 3)(*lengths), count=3,
                     src_format=PKV_FORMAT_F32, memory=PKV_MEMORY_HOST, k=ctypes.cast(k_buf, ctypes.c_void_p),
                     v=ctypes.cast(v_buf, ctypes.c_void_p))
        self.check(self.lib.pkv_write(pool, ctypes.byref(args)))
        for s, n in zip(seqs, lengths):
            got = U32()
            self.check(self.lib.pkv_seq_length(pool, s, ctypes.byref(got)))
            self.assertEqual(got.value, n)

        q = [rng.uniform(-2, 2) for _ in range(3 * q_heads * head_dim)]
        q_buf, out_buf, lse_buf = (F32 * len(q))(*q), (F32 * len(q))(), (F32 * (3 * q_heads))()
        args = sized(DecodeArgs, layer=layer, seqs=seqs, count=3, q_heads=q_heads, q_tokens=1, scale=0.0,
                     q_format=PKV_FORMAT_F32, out_format=PKV_FORMAT_F32, memory=PKV_MEMORY_HOST,
                     q=ctypes.cast(q_buf, ctypes.c_void_p), out=ctypes.cast(out_buf, ctypes.c_void_p),
                     lse=lse_buf)
        self.check(self.lib.pkv_decode(pool, ctypes.byref(args)))

        # float64 reference over the values the pages hold
        scale, first = 1.0 / math.sqrt(head_dim), 0
        for b, n in enumerate(lengths):
            for h in range(q_heads):
                qh = [as_f32(x) for x in q[(b * q_heads + h) * head_dim:][:head_dim]]
                base = (h // group) * head_dim
                keys = [[stored[k_format](k[(first + t) * row + base + d]) for d in range(head_dim)] for t in range(n)]
                vals = [[stored[v_format](v[(first + t) * row + base + d]) for d in range(head_dim)] for t in range(n)]
                logits = [scale * sum(a * c for a, c in zip(qh, key)) for key in keys]
                m = max(logits)
                weights = [math.exp(x - m) for x in logits]
                total_weight = sum(weights)
                ref = [sum(w * val[d] for w, val in zip(weights, vals)) / total_weight for d in range(head_dim)]
                got = out_buf[(b * q_heads + h) * head_dim:][:head_dim]
                err = math.sqrt(sum((g - r) ** 2 for g, r in zip(got, ref)))
                norm = math.sqrt(sum(r * r for r in ref))
                self.assertLess(err, 1e-4 * norm + 1e-6, f"sequence {b} head {h}")
                self.assertAlmostEqual(lse_buf[b * q_heads + h], m + math.log(total_weight), delta=1e-4)
            first += n

    def test_failures_reach_python(self):
        pool = self.open_pool(1, 32, PKV_FORMAT_F16, PKV_FORMAT_F16)
        seq = Seq()
        self.check(self.lib.pkv_seq_alloc(pool, ctypes.byref(seq)))
        self.check(self.lib.pkv_seq_free(pool, seq))
        self.assertEqual(self.lib.pkv_seq_free(pool, seq), PKV_ERR_STALE_HANDLE)
        text = self.lib.pkv_last_error().decode()
        self.assertTrue(text.startswith("PKV_ERR_STALE_HANDLE: pkv_seq_free: "), text)
        self.assertTrue(self.lib.pkv_status_string(PKV_ERR_STALE_HANDLE).decode().startswith("PKV_ERR_STALE_HANDLE"))

        ctx = ctypes.c_void_p()
        bad = sized(ContextDesc, backend=PKV_BACKEND_CPU)
        bad.struct_size = 4
        self.assertEqual(self.lib.pkv_context_create(ctypes.byref(bad), ctypes.byref(ctx)), PKV_ERR_STRUCT_SIZE)
        self.assertIn("struct_size is 4", self.lib.pkv_last_error().decode())

        # the detail is per thread: another thread's failure does not show here
        other = []
        worker = threading.Thread(target=lambda: other.append(
            (self.lib.pkv_seq_free(pool, Seq(0)), self.lib.pkv_last_error().decode())))
        worker.start()
        worker.join()
        self.assertEqual(other[0][0], PKV_ERR_STALE_HANDLE)
        self.assertIn("pkv_seq_free", other[0][1])
        self.assertIn("struct_size is 4", self.lib.pkv_last_error().decode())

    def test_function_table_version(self):
        api = ctypes.POINTER(Api)()
        self.check(self.lib.pkv_get_api(1, ctypes.byref(api)))
        newest = api.contents.api_version
        self.assertGreaterEqual(newest, 1)
        self.assertEqual(self.lib.pkv_get_api(newest + 1, ctypes.byref(api)), PKV_ERR_VERSION)
        text = self.lib.pkv_last_error().decode()
        self.assertIn(f"version {newest + 1} was asked for", text)
        self.assertIn(f"versions 1 to {newest}", text)


def main():
    seed = int(os.environ.get("PKV_TEST_SEED") or random.SystemRandom().randrange(1, 2**63))
    print(f"# PKV_TEST_SEED={seed}")
    Ffi.rng = random.Random(seed)
    Ffi.lib = load(sys.argv[1])
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(Ffi)
    result = unittest.TextTestRunner(stream=sys.stdout, verbosity=2).run(suite)
    sys.exit(0 if result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
