"""The C ABI as ctypes sees it: the library's location, its structs, their defaults and the functions'
signatures. Nothing here is public; pagedkv/__init__.py builds the Python API on it.

The defaults of the header's PKV_*_INIT macros live in this file only (STRUCT_DEFAULTS), and every
struct the package hands the library is made by new_struct(), which sets struct_size as the macros do.
The library refuses a struct whose struct_size is 0 (a zero-filled struct), so a binding must set it.
"""
from __future__ import annotations

import ctypes
import enum
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Type

U32, I32, U64, F32 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_float
ENUM = ctypes.c_int32  # every pagedkv enum is a 32-bit int


class Status(enum.IntEnum):
    OK = 0
    ERR_INVALID_ARGUMENT = 1
    ERR_STRUCT_SIZE = 2
    ERR_STALE_HANDLE = 3
    ERR_OUT_OF_PAGES = 4
    ERR_OUT_OF_SEQUENCES = 5
    ERR_OUT_OF_MEMORY = 6
    ERR_UNSUPPORTED = 7
    ERR_NO_DEVICE = 8
    ERR_BACKEND = 9
    ERR_VERSION = 10
    ERR_INTERNAL = 11


class Backend(enum.IntEnum):
    AUTO = 0
    CPU = 1
    CUDA = 2
    HIP = 3


class Format(enum.IntEnum):
    INVALID = 0
    F32 = 1
    F16 = 2
    BF16 = 3
    Q8_0 = 4
    Q4_0 = 5
    FP8_E4M3 = 6
    FP8_E5M2 = 7


class Memory(enum.IntEnum):
    HOST = 0
    DEVICE = 1
    HOST_PINNED = 2


class Seq(ctypes.Structure):
    _fields_ = [("id", U64)]


class ContextDesc(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("backend", ENUM), ("device", I32), ("threads", U32),
                ("stream", ctypes.c_void_p)]


class BackendInfo(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("backend", ENUM), ("compiled", I32), ("device_count", I32),
                ("detail", ctypes.c_char * 256)]


class PoolDesc(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("layers", U32), ("kv_heads", U32), ("head_dim", U32),
                ("page_size", U32), ("pages", U32), ("max_sequences", U32), ("k_format", ENUM),
                ("v_format", ENUM), ("page_order_seed", U32), ("max_sequence_length", U32)]


class WriteArgs(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("layer", U32), ("seqs", ctypes.POINTER(Seq)),
                ("n_tokens", ctypes.POINTER(U32)), ("count", U32), ("src_format", ENUM), ("memory", ENUM),
                ("k", ctypes.c_void_p), ("v", ctypes.c_void_p)]


class ReadArgs(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("layer", U32), ("seq", Seq), ("start", U32), ("count", U32),
                ("dst_format", ENUM), ("memory", ENUM), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p)]


class DecodeArgs(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("layer", U32), ("seqs", ctypes.POINTER(Seq)), ("count", U32),
                ("q_heads", U32), ("q_tokens", U32), ("scale", F32), ("q_format", ENUM), ("out_format", ENUM),
                ("memory", ENUM), ("q", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("lse", ctypes.c_void_p), ("chunk_pages", U32), ("sinks", ctypes.POINTER(F32)),
                ("alibi_slopes", ctypes.POINTER(F32)), ("window", U32), ("softcap", F32)]


class ExtendArgs(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("layer", U32), ("seqs", ctypes.POINTER(Seq)), ("count", U32),
                ("q_heads", U32), ("q_offsets", ctypes.POINTER(U32)), ("scale", F32), ("q_format", ENUM),
                ("out_format", ENUM), ("memory", ENUM), ("q", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("lse", ctypes.c_void_p), ("mask", ctypes.c_void_p), ("mask_offsets", ctypes.POINTER(U64)),
                ("mask_bytes", U64), ("sinks", ctypes.POINTER(F32)), ("alibi_slopes", ctypes.POINTER(F32)),
                ("window", U32), ("softcap", F32)]


class ScalesArgs(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("first_layer", U32), ("layer_count", U32), ("per_head", U32),
                ("k_scales", ctypes.POINTER(F32)), ("v_scales", ctypes.POINTER(F32))]


class PoolStats(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("pages_total", U32), ("pages_free", U32), ("pages_shared", U32),
                ("sequences_live", U32), ("max_sequences", U32), ("tokens_live", U64), ("bytes_total", U64),
                ("bytes_per_page", U64), ("bytes_per_token", U64)]


class ExportArgs(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("seq", Seq), ("first_layer", U32), ("layer_count", U32), ("memory", ENUM),
                ("image", ctypes.c_void_p), ("image_bytes", U64)]


class ImportArgs(ctypes.Structure):
    _fields_ = [("struct_size", U32), ("memory", ENUM), ("image", ctypes.c_void_p), ("image_bytes", U64)]


class MemoryRegion(ctypes.Structure):
    _fields_ = [("address", U64), ("bytes", U64)]


class PageSpan(ctypes.Structure):
    _fields_ = [("region", U32), ("layer", U32), ("index", U32), ("part", U32), ("offset", U64), ("bytes", U64)]


# The header's PKV_*_INIT macros, field by field (fields not named are 0 / NULL there too).
STRUCT_DEFAULTS: Dict[type, Dict[str, Any]] = {
    ContextDesc: {"backend": Backend.AUTO, "device": 0, "threads": 0, "stream": None},
    BackendInfo: {"backend": Backend.AUTO},
    PoolDesc: {"page_size": 16, "max_sequences": 256, "k_format": Format.F16, "v_format": Format.F16,
               "page_order_seed": 0, "max_sequence_length": 0},
    WriteArgs: {"src_format": Format.F32, "memory": Memory.HOST},
    ReadArgs: {"dst_format": Format.F32, "memory": Memory.HOST},
    DecodeArgs: {"q_tokens": 1, "scale": 0.0, "q_format": Format.F32, "out_format": Format.F32,
                 "memory": Memory.HOST, "chunk_pages": 0},
    ExtendArgs: {"scale": 0.0, "q_format": Format.F32, "out_format": Format.F32, "memory": Memory.HOST},
    PoolStats: {},
    ScalesArgs: {},
    ExportArgs: {"memory": Memory.HOST},
    ImportArgs: {"memory": Memory.HOST},
}


def new_struct(cls: Type[ctypes.Structure], **fields: Any) -> Any:
    """A struct as its PKV_*_INIT macro makes it, with `fields` set on top."""
    values = dict(STRUCT_DEFAULTS[cls])
    values.update(fields)
    return cls(struct_size=ctypes.sizeof(cls), **values)


_SIGNATURES = {
    "pkv_version": (U32, []),
    "pkv_version_string": (ctypes.c_char_p, []),
    "pkv_status_string": (ctypes.c_char_p, [ENUM]),
    "pkv_last_error": (ctypes.c_char_p, []),
    "pkv_backend_name": (ctypes.c_char_p, [ENUM]),
    "pkv_format_name": (ctypes.c_char_p, [ENUM]),
    "pkv_context_create": (ENUM, [ctypes.POINTER(ContextDesc), ctypes.POINTER(ctypes.c_void_p)]),
    "pkv_context_destroy": (ENUM, [ctypes.c_void_p]),
    "pkv_context_backend": (ENUM, [ctypes.c_void_p, ctypes.POINTER(ENUM)]),
    "pkv_context_synchronize": (ENUM, [ctypes.c_void_p]),
    "pkv_context_read_bandwidth": (ENUM, [ctypes.c_void_p, U64, ctypes.POINTER(ctypes.c_double)]),
    "pkv_backend_query": (ENUM, [ENUM, ctypes.POINTER(BackendInfo)]),
    "pkv_pool_create": (ENUM, [ctypes.c_void_p, ctypes.POINTER(PoolDesc), ctypes.POINTER(ctypes.c_void_p)]),
    "pkv_pool_destroy": (ENUM, [ctypes.c_void_p]),
    "pkv_seq_alloc": (ENUM, [ctypes.c_void_p, ctypes.POINTER(Seq)]),
    "pkv_seq_free": (ENUM, [ctypes.c_void_p, Seq]),
    "pkv_seq_fork": (ENUM, [ctypes.c_void_p, Seq, ctypes.POINTER(Seq)]),
    "pkv_seq_truncate": (ENUM, [ctypes.c_void_p, Seq, U32]),
    "pkv_seq_length": (ENUM, [ctypes.c_void_p, Seq, ctypes.POINTER(U32)]),
    "pkv_seq_release_before": (ENUM, [ctypes.c_void_p, Seq, U32]),
    "pkv_append": (ENUM, [ctypes.c_void_p, ctypes.POINTER(Seq), ctypes.POINTER(U32), U32]),
    "pkv_write": (ENUM, [ctypes.c_void_p, ctypes.POINTER(WriteArgs)]),
    "pkv_read": (ENUM, [ctypes.c_void_p, ctypes.POINTER(ReadArgs)]),
    "pkv_decode": (ENUM, [ctypes.c_void_p, ctypes.POINTER(DecodeArgs)]),
    "pkv_decode_prepare": (ENUM, [ctypes.c_void_p, ctypes.POINTER(DecodeArgs)]),
    "pkv_extend": (ENUM, [ctypes.c_void_p, ctypes.POINTER(ExtendArgs)]),
    "pkv_extend_prepare": (ENUM, [ctypes.c_void_p, ctypes.POINTER(ExtendArgs)]),
    "pkv_pool_get_stats": (ENUM, [ctypes.c_void_p, ctypes.POINTER(PoolStats)]),
    "pkv_pool_set_scales": (ENUM, [ctypes.c_void_p, ctypes.POINTER(ScalesArgs)]),
    "pkv_pool_get_scales": (ENUM, [ctypes.c_void_p, U32, U32, ctypes.POINTER(F32), ctypes.POINTER(F32)]),
    "pkv_convert_from_f32": (ENUM, [ENUM, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]),
    "pkv_convert_to_f32": (ENUM, [ENUM, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]),
    "pkv_format_row_bytes": (ctypes.c_size_t, [ENUM, ctypes.c_size_t]),
    "pkv_seq_export_size": (ENUM, [ctypes.c_void_p, ctypes.POINTER(ExportArgs), ctypes.POINTER(U64)]),
    "pkv_seq_export": (ENUM, [ctypes.c_void_p, ctypes.POINTER(ExportArgs)]),
    "pkv_seq_import": (ENUM, [ctypes.c_void_p, ctypes.POINTER(ImportArgs), ctypes.POINTER(Seq)]),
    "pkv_pool_regions": (ENUM, [ctypes.c_void_p, ctypes.POINTER(MemoryRegion), U32, ctypes.POINTER(U32)]),
    "pkv_seq_page_spans": (ENUM, [ctypes.c_void_p, Seq, U32, U32, ctypes.POINTER(PageSpan), U64, ctypes.POINTER(U64)]),
}

# The library's major version this package speaks (its soname carries it: libpagedkv.so.0).
ABI_MAJOR = 0


def _candidates() -> list:
    """Where the library is looked for, in order: $PAGEDKV_LIBRARY, this package's folder, then the
    system loader's search (LD_LIBRARY_PATH, the ldconfig cache, the system folders; PATH on Windows)."""
    found = []
    env = os.environ.get("PAGEDKV_LIBRARY")
    if env:
        found.append(env)
    here = Path(__file__).resolve().parent
    if sys.platform == "win32":
        names = ["pagedkv.dll"]
    elif sys.platform == "darwin":
        names = [f"libpagedkv.{ABI_MAJOR}.dylib", "libpagedkv.dylib"]
    else:
        names = [f"libpagedkv.so.{ABI_MAJOR}", "libpagedkv.so"]
    found += [str(here / n) for n in names if (here / n).exists()]
    found += names
    return found


_lib: Optional[ctypes.CDLL] = None


def lib() -> ctypes.CDLL:
    """The loaded library, opened on first use."""
    global _lib
    if _lib is not None:
        return _lib
    errors = []
    for candidate in _candidates():
        try:
            handle = ctypes.CDLL(candidate)
        except OSError as e:
            errors.append(f"{candidate}: {e}")
            if candidate == os.environ.get("PAGEDKV_LIBRARY"):
                break  # an explicit path that fails is the answer, not a reason to look elsewhere
            continue
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(handle, name)
            function.restype, function.argtypes = restype, argtypes
        major = handle.pkv_version() // 10000
        if major != ABI_MAJOR:
            raise ImportError(f"{candidate} is pagedkv {handle.pkv_version_string().decode()}; this package "
                              f"needs major version {ABI_MAJOR}")
        _lib = handle
        return handle
    raise ImportError(
        "libpagedkv could not be loaded (" + "; ".join(errors) + "). Set PAGEDKV_LIBRARY to the library's path "
        "(e.g. build/lib/libpagedkv.so), or install it (meson install) where the system loader finds it, "
        "or add its folder to LD_LIBRARY_PATH")
