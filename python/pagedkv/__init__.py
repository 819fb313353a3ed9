"""pagedkv from Python: paged K/V caches and paged-attention decode through the library's C ABI.

    import numpy as np, pagedkv
    with pagedkv.Context(backend="cpu") as ctx, ctx.pool(layers=2, kv_heads=4, head_dim=64, pages=64) as pool:
        seq = pool.alloc()
        pool.append([seq], [3])
        pool.write(0, [seq], [3], k, v)        # k, v: [3, kv_heads, head_dim] float32 / float16
        out = pool.decode(0, [seq], q)         # q: [1, q_heads, head_dim]

Arrays are numpy arrays in host memory, or torch tensors (host or GPU: their data pointer is passed,
and a GPU tensor must be used on the stream the context was created with). A failed call raises a
PagedKVError subclass carrying the status and the library's detail text (pkv_last_error()).
The library is found through $PAGEDKV_LIBRARY, this package's folder, or the system loader.

One module past 500 lines: the whole public Python API, as one import sees it.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Sequence as SequenceT, Tuple, Union

from . import _ffi
from ._ffi import Backend, Format, Memory, Status

__version__ = "0.1.0"

__all__ = [
    "__version__", "Backend", "Format", "Memory", "Status", "Context", "Pool", "Sequence", "PoolStats",
    "BackendInfo", "MemoryRegion", "PageSpan", "PagedKVError", "InvalidArgumentError", "StructSizeError", "StaleHandleError",
    "OutOfPagesError", "OutOfSequencesError", "OutOfMemoryError", "UnsupportedError", "NoDeviceError",
    "BackendError", "VersionError", "InternalError", "library_version", "backends",
]


class PagedKVError(Exception):
    """A failed library call: `status` (a Status, or the int of a status this package does not know),
    `function` (the C function called) and `detail` (pkv_last_error(): "STATUS: function: what")."""

    def __init__(self, status: int, function: str, detail: str):
        try:
            self.status: Union[Status, int] = Status(status)
        except ValueError:
            self.status = status
        self.function = function
        self.detail = detail
        super().__init__(detail or f"{_ffi.lib().pkv_status_string(status).decode()} ({function})")


class InvalidArgumentError(PagedKVError, ValueError):
    pass


class StructSizeError(PagedKVError):
    pass


class StaleHandleError(PagedKVError):
    pass


class OutOfPagesError(PagedKVError):
    pass


class OutOfSequencesError(PagedKVError):
    pass


class OutOfMemoryError(PagedKVError, MemoryError):
    pass


class UnsupportedError(PagedKVError):
    pass


class NoDeviceError(PagedKVError):
    pass


class BackendError(PagedKVError):
    pass


class VersionError(PagedKVError):
    pass


class InternalError(PagedKVError):
    pass


_ERRORS = {
    Status.ERR_INVALID_ARGUMENT: InvalidArgumentError, Status.ERR_STRUCT_SIZE: StructSizeError,
    Status.ERR_STALE_HANDLE: StaleHandleError, Status.ERR_OUT_OF_PAGES: OutOfPagesError,
    Status.ERR_OUT_OF_SEQUENCES: OutOfSequencesError, Status.ERR_OUT_OF_MEMORY: OutOfMemoryError,
    Status.ERR_UNSUPPORTED: UnsupportedError, Status.ERR_NO_DEVICE: NoDeviceError,
    Status.ERR_BACKEND: BackendError, Status.ERR_VERSION: VersionError, Status.ERR_INTERNAL: InternalError,
}


def _call(name: str, *args: Any) -> None:
    """Calls pkv_<name>; a failure raises with the detail text read at once, on this thread."""
    lib = _ffi.lib()
    status = getattr(lib, name)(*args)
    if status != Status.OK:
        detail = lib.pkv_last_error().decode(errors="replace")
        raise _ERRORS.get(status, PagedKVError)(status, name, detail)


def library_version() -> str:
    """The version of the library loaded ("0.1.0"), which may differ from __version__."""
    return _ffi.lib().pkv_version_string().decode()


def _enum(kind: type, value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return kind[value.upper()]
        except KeyError:
            names = ", ".join(m.name.lower() for m in kind if m.value)
            raise ValueError(f"{what} is {value!r}: expected one of {names}") from None
    return kind(value)


@dataclass(frozen=True)
class BackendInfo:
    backend: Backend
    compiled: bool
    device_count: int
    detail: str


def backends() -> List[BackendInfo]:
    """What each backend offers in this library on this machine (what pkv-info prints)."""
    result = []
    for b in (Backend.CPU, Backend.CUDA, Backend.HIP):
        info = _ffi.new_struct(_ffi.BackendInfo)
        _call("pkv_backend_query", b, ctypes.byref(info))
        result.append(BackendInfo(b, bool(info.compiled), info.device_count, info.detail.decode(errors="replace")))
    return result


# ---- arrays: numpy in host memory, torch tensors anywhere -----------------------------------------

_NUMPY_FORMATS = {"float32": Format.F32, "float16": Format.F16}
_TORCH_FORMATS = {"torch.float32": Format.F32, "torch.float16": Format.F16, "torch.bfloat16": Format.BF16}
_ELEMENT_BYTES = {Format.F32: 4, Format.F16: 2, Format.BF16: 2}


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


@dataclass
class _Buffer:
    array: Any  # kept alive while the call runs
    ptr: int
    format: Format
    memory: Memory
    shape: Tuple[int, ...]
    torch_device: Any = None


def _buffer(x: Any, what: str, fmt: Optional[Any] = None, output: bool = False) -> _Buffer:
    """An array's pointer, element format and memory kind. Host inputs that are not numpy arrays of
    float32/float16 (lists, float64 arrays) are converted to float32; outputs must already fit."""
    if _is_torch(x):
        if not x.is_contiguous():
            raise ValueError(f"{what} must be contiguous (tensor.contiguous())")
        got = _TORCH_FORMATS.get(str(x.dtype))
        if got is None:
            raise ValueError(f"{what} has dtype {x.dtype}: expected float32, float16 or bfloat16")
        if fmt is not None and _enum(Format, fmt, what) != got:
            raise ValueError(f"{what} has dtype {x.dtype}, not the format {fmt} asked for")
        device = x.device.type != "cpu"
        return _Buffer(x, x.data_ptr(), got, Memory.DEVICE if device else Memory.HOST, tuple(x.shape),
                       x.device if device else None)
    import numpy as np

    want = None if fmt is None else _enum(Format, fmt, what)
    if output:
        if not isinstance(x, np.ndarray) or not x.flags.c_contiguous or not x.flags.writeable:
            raise ValueError(f"{what} must be a writable, C-contiguous numpy array or a torch tensor")
    elif not isinstance(x, np.ndarray) or (x.dtype.name not in _NUMPY_FORMATS and want is None):
        x = np.asarray(x, dtype=np.float32)
    x = x if x.flags.c_contiguous else np.ascontiguousarray(x)
    if want == Format.BF16:
        if x.dtype != np.uint16:
            raise ValueError(f"{what}: bf16 data is passed as a numpy uint16 array of its bits, not {x.dtype}")
        got = Format.BF16
    else:
        got = _NUMPY_FORMATS.get(x.dtype.name)
        if got is None or (want is not None and want != got):
            raise ValueError(f"{what} has dtype {x.dtype}: expected " + (want.name.lower() if want else "float32 or float16"))
    return _Buffer(x, x.ctypes.data, got, Memory.HOST, tuple(x.shape))


def _same_memory(buffers: Iterable[Optional[_Buffer]], stream: int, names: str) -> Memory:
    """q, out and lse (and k and v) share one pkv_memory field: all host or all device. Device tensors
    must be used on the context's stream, which orders the library's work with torch's."""
    present = [b for b in buffers if b is not None]
    kinds = {b.memory for b in present}
    if len(kinds) > 1:
        raise ValueError(f"{names} must all be in host memory or all on the device: one memory field covers them")
    memory = kinds.pop()
    if memory == Memory.DEVICE and not stream:
        raise ValueError(f"{names} are device tensors but the context runs on the library's own stream, which "
                         "torch's work is not ordered with: create the context with a torch.cuda.Stream "
                         "(Context(backend='cuda', stream=s)) and call it while that stream is current")
    if memory == Memory.DEVICE:
        import torch

        current = torch.cuda.current_stream(present[0].torch_device).cuda_stream
        if current != stream:
            raise ValueError(
                f"torch's current stream (0x{current:x}) is not the context's (0x{stream:x}): create the context "
                "with Context(backend='cuda', stream=torch.cuda.current_stream()) and call it on that stream")
    return memory


@dataclass
class _Raw:
    array: Any  # kept alive while the call runs
    ptr: int
    nbytes: int
    memory: Memory


def _raw(x: Any, what: str, writable: bool) -> _Raw:
    """A byte buffer's pointer, size and memory kind: a torch tensor (host, pinned host or GPU), or host
    memory Python exposes as a buffer (numpy arrays, bytearray; bytes when only read)."""
    if _is_torch(x):
        if not x.is_contiguous():
            raise ValueError(f"{what} must be contiguous (tensor.contiguous())")
        memory = Memory.DEVICE if x.device.type != "cpu" else Memory.HOST_PINNED if x.is_pinned() else Memory.HOST
        return _Raw(x, x.data_ptr(), x.numel() * x.element_size(), memory)
    import numpy as np

    arr = x if isinstance(x, np.ndarray) else np.frombuffer(x, np.uint8)
    if not arr.flags.c_contiguous or (writable and not arr.flags.writeable):
        raise ValueError(f"{what} must be a {'writable, ' if writable else ''}C-contiguous buffer")
    return _Raw(arr, arr.ctypes.data, arr.nbytes, Memory.HOST)


def _seq_array(seqs: SequenceT["Sequence"], pool: "Pool") -> Any:
    arr = (_ffi.Seq * len(seqs))()
    for i, s in enumerate(seqs):
        if not isinstance(s, Sequence) or s.pool is not pool:
            raise ValueError(f"seqs[{i}] is not a Sequence of this pool")
        arr[i] = s.handle
    return arr


def _counts(n: Union[int, SequenceT[int]], count: int, what: str) -> Any:
    values = [n] * count if isinstance(n, int) else list(n)
    if len(values) != count:
        raise ValueError(f"{what} has {len(values)} entries for {count} sequences")
    if any(v < 0 or v > 0xFFFFFFFF for v in values):
        raise ValueError(f"{what} holds a value outside 0..2^32-1")
    return (_ffi.U32 * count)(*values)


# ---- contexts, pools, sequences -------------------------------------------------------------------

class Context:
    """One backend on one device with one stream (pkv_context). Use as a context manager, or close()."""

    def __init__(self, backend: Union[Backend, str, int] = Backend.AUTO, device: int = 0, threads: int = 0,
                 stream: Any = None):
        """backend: auto (the environment's PKV_BACKEND, else the first that works), cpu, cuda or hip.
        threads: the CPU backend's workers (0: one per hardware thread); on a GPU backend, the threads
        that pack a large write from host memory (0: 4, or the hardware's if fewer). stream: the
        engine's CUstream / hipStream_t as an int, or an object with a cuda_stream attribute
        (torch.cuda.Stream)."""
        self._ptr = ctypes.c_void_p()
        self.stream = int(getattr(stream, "cuda_stream", stream) or 0)
        desc = _ffi.new_struct(_ffi.ContextDesc, backend=_enum(Backend, backend, "backend"), device=device,
                               threads=threads, stream=self.stream or None)
        _call("pkv_context_create", ctypes.byref(desc), ctypes.byref(self._ptr))
        self._pools: List["Pool"] = []

    @property
    def backend(self) -> Backend:
        out = _ffi.ENUM()
        _call("pkv_context_backend", self._handle(), ctypes.byref(out))
        return Backend(out.value)

    def _handle(self) -> ctypes.c_void_p:
        if not self._ptr:
            raise ValueError("the context is closed")
        return self._ptr

    def pool(self, **desc: Any) -> "Pool":
        """A pool (pkv_pool_desc's fields as keywords: layers, kv_heads, head_dim, pages, page_size,
        max_sequences, k_format, v_format, page_order_seed, max_sequence_length)."""
        return Pool(self, **desc)

    def synchronize(self) -> None:
        _call("pkv_context_synchronize", self._handle())

    def read_bandwidth(self, nbytes: int = 0) -> float:
        """The device's read bandwidth in GB/s (blocks for a while)."""
        out = ctypes.c_double()
        _call("pkv_context_read_bandwidth", self._handle(), nbytes, ctypes.byref(out))
        return out.value

    def close(self) -> None:
        """Destroys the context; its pools must be closed first."""
        live = [p for p in self._pools if p._ptr]
        if live:
            raise ValueError(f"the context still has {len(live)} open pool(s): close them first")
        if self._ptr:
            _call("pkv_context_destroy", self._ptr)
            self._ptr = ctypes.c_void_p()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self._pools:
            p.close()
        self.close()

    def __del__(self) -> None:
        # Each pool holds its context, so a collected context's open pools are unreachable too (a
        # reference cycle the collector frees in any order): they are closed first, so the context
        # and its device memory are not left behind.
        try:
            for p in self._pools:
                p.close()
            self.close()
        except Exception:
            pass


@dataclass(frozen=True)
class PoolStats:
    pages_total: int
    pages_free: int
    pages_shared: int
    sequences_live: int
    max_sequences: int
    tokens_live: int
    bytes_total: int
    bytes_per_page: int
    bytes_per_token: int


class Pool:
    """Pages for every layer of one model (pkv_pool). Use as a context manager, or close()."""

    def __init__(self, ctx: Context, **desc: Any):
        for key in ("k_format", "v_format"):
            if key in desc:
                desc[key] = _enum(Format, desc[key], key)
        known = {name for name, _ in _ffi.PoolDesc._fields_} - {"struct_size"}
        unknown = set(desc) - known
        if unknown:
            raise TypeError(f"unknown pool field(s) {sorted(unknown)}: expected some of {sorted(known)}")
        d = _ffi.new_struct(_ffi.PoolDesc, **desc)
        self.ctx = ctx
        self._ptr = ctypes.c_void_p()
        _call("pkv_pool_create", ctx._handle(), ctypes.byref(d), ctypes.byref(self._ptr))
        ctx._pools.append(self)
        self.layers, self.kv_heads, self.head_dim = d.layers, d.kv_heads, d.head_dim
        self.page_size, self.pages = d.page_size, d.pages
        self.k_format, self.v_format = Format(d.k_format), Format(d.v_format)

    def _handle(self) -> ctypes.c_void_p:
        if not self._ptr:
            raise ValueError("the pool is closed")
        return self._ptr

    def close(self) -> None:
        if self._ptr:
            _call("pkv_pool_destroy", self._ptr)
            self._ptr = ctypes.c_void_p()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def alloc(self) -> "Sequence":
        """A new, empty sequence."""
        handle = _ffi.Seq()
        _call("pkv_seq_alloc", self._handle(), ctypes.byref(handle))
        return Sequence(self, handle)

    def append(self, seqs: SequenceT["Sequence"], n_new: Union[int, SequenceT[int]]) -> None:
        """Adds n_new[i] token slots to seqs[i]: all of them or, raising, none. A sequence may appear
        once per call."""
        _call("pkv_append", self._handle(), _seq_array(seqs, self), _counts(n_new, len(seqs), "n_new"), len(seqs))

    def write(self, layer: int, seqs: SequenceT["Sequence"], n_tokens: Union[int, SequenceT[int]], k: Any, v: Any,
              src_format: Any = None) -> None:
        """K/V rows of one layer for the newest n_tokens[i] positions of seqs[i]: k and v are
        [sum n_tokens, kv_heads, head_dim] (float32, float16, or uint16 bits with src_format='bf16')."""
        counts = _counts(n_tokens, len(seqs), "n_tokens")
        kb, vb = _buffer(k, "k", src_format), _buffer(v, "v", src_format)
        want = (sum(counts), self.kv_heads, self.head_dim)
        for b, name in ((kb, "k"), (vb, "v")):
            if math.prod(b.shape) != math.prod(want):
                raise ValueError(f"{name} has shape {b.shape}: expected {want} (sum of n_tokens, kv_heads, head_dim)")
        if kb.format != vb.format:
            raise ValueError(f"k is {kb.format.name.lower()} and v {vb.format.name.lower()}: one src_format covers both")
        memory = _same_memory([kb, vb], self.ctx.stream, "k and v")
        args = _ffi.new_struct(_ffi.WriteArgs, layer=layer, seqs=_seq_array(seqs, self), n_tokens=counts,
                               count=len(seqs), src_format=kb.format, memory=memory, k=kb.ptr, v=vb.ptr)
        _call("pkv_write", self._handle(), ctypes.byref(args))

    def read(self, layer: int, seq: "Sequence", start: int = 0, count: Optional[int] = None) -> Tuple[Any, Any]:
        """Rows [start, start + count) of one layer, dequantized to float32 numpy arrays
        [count, kv_heads, head_dim] (K, V)."""
        import numpy as np

        if count is None:
            count = len(seq) - start
        k = np.empty((count, self.kv_heads, self.head_dim), np.float32)
        v = np.empty_like(k)
        args = _ffi.new_struct(_ffi.ReadArgs, layer=layer, seq=seq.handle, start=start, count=count,
                               dst_format=Format.F32, k=k.ctypes.data, v=v.ctypes.data)
        _call("pkv_read", self._handle(), ctypes.byref(args))
        return k, v

    @staticmethod
    def _variants(args: Any, q_heads: int, window: int, softcap: float, sinks: Any, alibi_slopes: Any) -> list:
        """Sets the attention variants' fields of decode or extend args (pagedkv.h, section 7a);
        returns the float32 arrays they point into, to be kept alive over the call. sinks and
        alibi_slopes live where q does (args.memory): host values (numpy, lists, CPU tensors) with host
        q, float32 tensors on q's device with device q."""
        args.window, args.softcap = window, softcap
        kept = []
        for name, values in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
            if values is None:
                continue
            if not _is_torch(values):
                import numpy as np

                values = np.asarray(values, np.float32)
            b = _buffer(values, name, fmt=Format.F32)
            if b.shape != (q_heads,):
                raise ValueError(f"{name} has shape {b.shape}: expected one value per query head, ({q_heads},)")
            if (b.memory == Memory.DEVICE) != (args.memory == Memory.DEVICE):
                raise ValueError(f"{name} must be where q is: " + ("on its device" if args.memory == Memory.DEVICE
                                                                    else "in host memory"))
            setattr(args, name, ctypes.cast(ctypes.c_void_p(b.ptr), ctypes.POINTER(_ffi.F32)))
            kept.append(b.array)
        return kept

    def _decode_args(self, layer: int, seqs: SequenceT["Sequence"], q: Any, out: Any, lse: Any, scale: float,
                     chunk_pages: int) -> Tuple[Any, _Buffer, _Buffer, Optional[_Buffer]]:
        qb = _buffer(q, "q")
        if len(qb.shape) not in (3, 4) or qb.shape[0] != len(seqs) or qb.shape[-1] != self.head_dim:
            raise ValueError(f"q has shape {qb.shape}: expected [count={len(seqs)}, q_heads, head_dim={self.head_dim}] "
                             "or [count, q_tokens, q_heads, head_dim]")
        q_tokens = qb.shape[1] if len(qb.shape) == 4 else 1
        q_heads = qb.shape[-2]
        ob, lb, memory = _outputs(qb, out, lse, self.ctx.stream)
        args = _ffi.new_struct(_ffi.DecodeArgs, layer=layer, seqs=_seq_array(seqs, self), count=len(seqs),
                               q_heads=q_heads, q_tokens=q_tokens, scale=scale, q_format=qb.format,
                               out_format=ob.format, memory=memory, q=qb.ptr, out=ob.ptr,
                               lse=lb.ptr if lb else None, chunk_pages=chunk_pages)
        return args, qb, ob, lb

    def decode(self, layer: int, seqs: SequenceT["Sequence"], q: Any, *, out: Any = None, lse: Any = None,
               scale: float = 0.0, chunk_pages: int = 0, window: int = 0, softcap: float = 0.0,
               sinks: Any = None, alibi_slopes: Any = None, prepare: bool = False) -> Any:
        """Attention of q over each sequence's cached tokens for one layer. q is [count, q_heads,
        head_dim], or [count, q_tokens, q_heads, head_dim] with q_tokens 1..8 (query token t of a
        sequence of length L sees positions 0..L - q_tokens + t). Returns out (q's shape and dtype, or
        the array given), or (out, lse) when lse is True or an array (float32, q's shape without
        head_dim). scale 0 means 1/sqrt(head_dim). A sequence may appear more than once. The
        variants (pagedkv.h, section 7a; each off at its default): window (positions), softcap, sinks
        and alibi_slopes (one value per query head each, where q is). prepare=True calls
        pkv_decode_prepare instead, for a decode captured in a CUDA graph (docs/api.md): the batch's
        plan goes on the device, q, out and lse give only their shapes, formats and memory, nothing is
        attended, and it returns None."""
        args, _q, ob, lb = self._decode_args(layer, seqs, q, out, lse, scale, chunk_pages)
        _kept = self._variants(args, args.q_heads, window, softcap, sinks, alibi_slopes)
        _call("pkv_decode_prepare" if prepare else "pkv_decode", self._handle(), ctypes.byref(args))
        if prepare:
            return None
        return (ob.array, lb.array) if lb else ob.array

    def extend(self, layer: int, seqs: SequenceT["Sequence"], tokens: SequenceT[int], q: Any, *, out: Any = None,
               lse: Any = None, scale: float = 0.0, masks: Optional[SequenceT[Any]] = None, window: int = 0,
               softcap: float = 0.0, sinks: Any = None, alibi_slopes: Any = None, prepare: bool = False) -> Any:
        """Attention of each sequence's newest tokens[b] positions (already appended and written) over
        all it holds, for one layer (pkv_extend): chunked prefill, new tokens after a prefix hit,
        speculative chains and trees. q is [sum(tokens), q_heads, head_dim], sequence b's queries
        after those of the sequences before it; query i of b sees positions up to its own (causal),
        or, with masks (one [tokens[b], tokens[b]] boolean array per sequence, row i the new tokens
        query i sees: itself and none after it), every position before the new tokens and the new
        tokens its row marks. Returns out (q's shape and dtype, or the array given), or (out, lse)
        when lse is True or an array (float32, q's shape without head_dim). A sequence may appear
        more than once. The variants and prepare=True (pkv_extend_prepare) are decode's."""
        import numpy as np

        if len(tokens) != len(seqs):
            raise ValueError(f"{len(tokens)} token counts for {len(seqs)} sequences")
        offsets = (_ffi.U32 * (len(seqs) + 1))(0, *np.cumsum(tokens, dtype=np.uint64).tolist())
        qb = _buffer(q, "q")
        if len(qb.shape) != 3 or qb.shape[0] != offsets[len(seqs)] or qb.shape[-1] != self.head_dim:
            raise ValueError(f"q has shape {qb.shape}: expected [sum(tokens)={offsets[len(seqs)]}, q_heads, "
                             f"head_dim={self.head_dim}]")
        ob, lb, memory = _outputs(qb, out, lse, self.ctx.stream)
        args = _ffi.new_struct(_ffi.ExtendArgs, layer=layer, seqs=_seq_array(seqs, self), count=len(seqs),
                               q_heads=qb.shape[1], q_offsets=offsets, scale=scale, q_format=qb.format,
                               out_format=ob.format, memory=memory, q=qb.ptr, out=ob.ptr,
                               lse=lb.ptr if lb else None)
        _kept = self._variants(args, qb.shape[1], window, softcap, sinks, alibi_slopes)
        if masks is not None:
            if len(masks) != len(seqs):
                raise ValueError(f"{len(masks)} masks for {len(seqs)} sequences")
            rows = []
            for n, m in zip(tokens, masks):
                m = np.asarray(m, bool)
                if m.shape != (n, n):
                    raise ValueError(f"a mask has shape {m.shape}: expected its sequence's ({n}, {n})")
                rows.append(np.packbits(m, axis=1, bitorder="little").reshape(-1))
            starts = np.cumsum([0] + [r.size for r in rows], dtype=np.uint64)[:-1]
            mask_offsets = (_ffi.U64 * len(seqs))(*starts.tolist())
            packed = np.ascontiguousarray(np.concatenate(rows) if rows else np.zeros(0, np.uint8))  # lives past the call
            args.mask, args.mask_offsets, args.mask_bytes = packed.ctypes.data, mask_offsets, packed.size
        _call("pkv_extend_prepare" if prepare else "pkv_extend", self._handle(), ctypes.byref(args))
        if prepare:
            return None
        return (ob.array, lb.array) if lb else ob.array

    def _export_args(self, seq: "Sequence", first_layer: int, layer_count: int) -> Any:
        if not isinstance(seq, Sequence) or seq.pool is not self:
            raise ValueError("seq is not a Sequence of this pool")
        return _ffi.new_struct(_ffi.ExportArgs, seq=seq.handle, first_layer=first_layer, layer_count=layer_count)

    def export_size(self, seq: "Sequence", first_layer: int = 0, layer_count: int = 0) -> int:
        """Bytes of seq's image over layers [first_layer, first_layer + layer_count) (0: to the last)."""
        args = self._export_args(seq, first_layer, layer_count)
        out = _ffi.U64()
        _call("pkv_seq_export_size", self._handle(), ctypes.byref(args), ctypes.byref(out))
        return out.value

    def export_seq(self, seq: "Sequence", out: Any = None, first_layer: int = 0, layer_count: int = 0) -> Any:
        """seq's image (pkv_seq_export): its pages as stored, with a header and checksums. Into `out`
        (a writable buffer or a torch tensor, host, pinned or on the GPU, of at least export_size()
        bytes), or a new numpy uint8 array. A pinned or GPU `out` is complete once the context's
        stream has run past the call (Context.synchronize())."""
        import numpy as np

        args = self._export_args(seq, first_layer, layer_count)
        size = self.export_size(seq, first_layer, layer_count)
        buf = _raw(np.empty(size, np.uint8) if out is None else out, "out", writable=True)
        if buf.memory == Memory.DEVICE:
            _same_memory([_Buffer(buf.array, buf.ptr, Format.INVALID, buf.memory, (), buf.array.device)],
                         self.ctx.stream, "out")
        args.memory, args.image, args.image_bytes = buf.memory, buf.ptr, buf.nbytes
        _call("pkv_seq_export", self._handle(), ctypes.byref(args))
        return buf.array

    def import_seq(self, image: Any) -> "Sequence":
        """A new sequence holding an image's tokens (pkv_seq_import): bytes, a buffer, or a torch tensor
        (host, pinned or on the GPU). Nothing changes when it raises (a corrupted or truncated image, a
        pool of another geometry, too few pages or slots)."""
        buf = _raw(image, "image", writable=False)
        args = _ffi.new_struct(_ffi.ImportArgs, memory=buf.memory, image=buf.ptr, image_bytes=buf.nbytes)
        handle = _ffi.Seq()
        _call("pkv_seq_import", self._handle(), ctypes.byref(args), ctypes.byref(handle))
        return Sequence(self, handle)

    def regions(self) -> List["MemoryRegion"]:
        """The pool's memory (pkv_pool_regions): device memory on a GPU, what a transfer engine registers."""
        count = _ffi.U32()
        _call("pkv_pool_regions", self._handle(), None, 0, ctypes.byref(count))
        regions = (_ffi.MemoryRegion * count.value)()
        _call("pkv_pool_regions", self._handle(), regions, count.value, ctypes.byref(count))
        return [MemoryRegion(r.address, r.bytes) for r in regions]

    def set_scales(self, k: Any = None, v: Any = None, first_layer: int = 0) -> None:
        """FP8 pages' scales (pkv_pool_set_scales) of the layers from first_layer on: k and v are
        [layers] (a scale per layer) or [layers, kv_heads] (per KV head), the same shape for both;
        None leaves a plane's. Only FP8 planes take scales; set them before writing their rows."""
        import numpy as np

        given = [None if x is None else np.ascontiguousarray(x, dtype=np.float32) for x in (k, v)]
        shapes = {x.shape for x in given if x is not None}
        if len(shapes) > 1:
            raise ValueError(f"k and v scales have shapes {sorted(shapes)}: one shape covers both")
        shape = shapes.pop() if shapes else (1,)
        if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != self.kv_heads) or shape[0] == 0:
            raise ValueError(f"scales have shape {shape}: expected (layers,) or (layers, {self.kv_heads})")
        ptr = [None if x is None else x.ctypes.data_as(ctypes.POINTER(_ffi.F32)) for x in given]
        args = _ffi.new_struct(_ffi.ScalesArgs, first_layer=first_layer, layer_count=shape[0],
                               per_head=int(len(shape) == 2), k_scales=ptr[0], v_scales=ptr[1])
        _call("pkv_pool_set_scales", self._handle(), ctypes.byref(args))

    def scales(self) -> Tuple[List[List[float]], List[List[float]]]:
        """(k, v): every layer's scales per KV head (pkv_pool_get_scales); 1.0 for a plane not FP8."""
        n = self.layers * self.kv_heads
        k, v = (_ffi.F32 * n)(), (_ffi.F32 * n)()
        _call("pkv_pool_get_scales", self._handle(), 0, 0, k, v)
        h = self.kv_heads
        return ([list(k[i * h:(i + 1) * h]) for i in range(self.layers)],
                [list(v[i * h:(i + 1) * h]) for i in range(self.layers)])

    def stats(self) -> PoolStats:
        s = _ffi.new_struct(_ffi.PoolStats)
        _call("pkv_pool_get_stats", self._handle(), ctypes.byref(s))
        return PoolStats(*(getattr(s, name) for name, _ in _ffi.PoolStats._fields_[1:]))


@dataclass(frozen=True)
class MemoryRegion:
    address: int
    bytes: int


@dataclass(frozen=True)
class PageSpan:
    """One K (part 0) or V (part 1) part of one page of one layer of a sequence, at `offset` bytes into
    region `region` of Pool.regions()."""
    region: int
    layer: int
    index: int
    part: int
    offset: int
    bytes: int


def _outputs(qb: _Buffer, out: Any, lse: Any, stream: int) -> Tuple[_Buffer, Optional[_Buffer], Memory]:
    """decode's and extend's out (given, or made like q) and lse (an array, True to make one, or
    None/False), checked against q's shape, and the memory all three share."""
    if out is None:
        out = _empty_like(qb)
    ob = _buffer(out, "out", output=True)
    if ob.shape != qb.shape:
        raise ValueError(f"out has shape {ob.shape}: expected q's, {qb.shape}")
    lb = None
    if lse is True:
        lse = _empty_like(qb, qb.shape[:-1], Format.F32)
    if lse is not None and lse is not False:
        lb = _buffer(lse, "lse", output=True)
        if lb.format != Format.F32 or lb.shape != qb.shape[:-1]:
            raise ValueError(f"lse must be float32 of shape {qb.shape[:-1]}")
    return ob, lb, _same_memory([qb, ob, lb], stream, "q, out and lse")


def _empty_like(b: _Buffer, shape: Optional[Tuple[int, ...]] = None, fmt: Optional[Format] = None) -> Any:
    shape = b.shape if shape is None else shape
    fmt = b.format if fmt is None else fmt
    if _is_torch(b.array):
        import torch

        dtype = {Format.F32: torch.float32, Format.F16: torch.float16, Format.BF16: torch.bfloat16}[fmt]
        return torch.empty(shape, dtype=dtype, device=b.array.device)
    import numpy as np

    return np.empty(shape, {Format.F32: np.float32, Format.F16: np.float16, Format.BF16: np.uint16}[fmt])


class Sequence:
    """One sequence of a pool (a pkv_seq handle). As a context manager it is freed on exit."""

    def __init__(self, pool: Pool, handle: Any):
        self.pool = pool
        self.handle = handle
        self._freed = False

    @property
    def id(self) -> int:
        return self.handle.id

    def __len__(self) -> int:
        out = _ffi.U32()
        _call("pkv_seq_length", self.pool._handle(), self.handle, ctypes.byref(out))
        return out.value

    def __repr__(self) -> str:
        return f"<pagedkv.Sequence 0x{self.handle.id:016x}>"

    def fork(self) -> "Sequence":
        """A new sequence with this one's tokens, sharing its pages."""
        child = _ffi.Seq()
        _call("pkv_seq_fork", self.pool._handle(), self.handle, ctypes.byref(child))
        return Sequence(self.pool, child)

    def truncate(self, length: int) -> None:
        """Rolls back to `length` tokens (rejected speculative tokens); whole pages past it are freed."""
        _call("pkv_seq_truncate", self.pool._handle(), self.handle, length)

    def release_before(self, position: int) -> None:
        """Gives back the pages wholly before `position` (pkv_seq_release_before): positions below it
        are released, and a decode, extend, read or write that needs one raises InvalidArgumentError."""
        _call("pkv_seq_release_before", self.pool._handle(), self.handle, position)

    def page_spans(self, first_layer: int = 0, layer_count: int = 0) -> List[PageSpan]:
        """Where this sequence's pages lie in the pool's regions (pkv_seq_page_spans), in an image's
        payload order: [layer][page][K, V]."""
        pool = self.pool._handle()
        count = _ffi.U64()
        _call("pkv_seq_page_spans", pool, self.handle, first_layer, layer_count, None, 0, ctypes.byref(count))
        spans = (_ffi.PageSpan * count.value)()
        _call("pkv_seq_page_spans", pool, self.handle, first_layer, layer_count, spans, count.value, ctypes.byref(count))
        return [PageSpan(s.region, s.layer, s.index, s.part, s.offset, s.bytes) for s in spans]

    def free(self) -> None:
        """Returns the pages; the handle is stale afterwards (using it raises StaleHandleError)."""
        _call("pkv_seq_free", self.pool._handle(), self.handle)
        self._freed = True

    def __enter__(self) -> "Sequence":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool._ptr and not self._freed:
            self.free()
