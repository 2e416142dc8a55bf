"""A cheap device-to-host notification for the JAX backend on CPU.

`send(fit_id, values)` emits, inside a jitted program, a call of one XLA FFI target
("stepfuse_notify") whose handler is a Python function reached through ``ctypes``. The
handler reads the int32 ``values`` and hands them to the receiver registered under
``fit_id``. It does what ``jax.debug.callback`` does for the in-loop callback, at a
fraction of the cost on XLA:CPU (no host arrays to build, no result to return).

The handler follows XLA's FFI C API (``xla/ffi/api/c_api.h``, shipped with jaxlib at
``jax.ffi.include_dir()``): a call frame with the execution stage and the argument
buffers, plus a metadata query at registration time. `available()` registers the target
once and checks it end to end on a tiny program; anything unexpected (another platform,
an ABI change) makes it return False and the backend keeps ``jax.debug.callback``.
"""

from __future__ import annotations

import ctypes as C
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["available", "register", "send"]

_TARGET = "stepfuse_notify"
_EXT_METADATA = 1  # XLA_FFI_Extension_Metadata
_STAGE_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_ARG_BUFFER = 1  # XLA_FFI_ArgType_BUFFER
_S32 = 4  # XLA_FFI_DataType_S32 (the PrimitiveType number)
_API_MAJOR, _API_MINOR = 0, 1  # the oldest C API whose layout this module follows


class _ExtBase(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("type", C.c_int), ("next", C.c_void_p)]


class _ApiVersion(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("major_version", C.c_int),
        ("minor_version", C.c_int),
    ]


class _Metadata(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("api_version", _ApiVersion), ("traits", C.c_uint32)]


class _MetadataExt(C.Structure):
    _fields_ = [("extension_base", _ExtBase), ("metadata", C.POINTER(_Metadata))]


_receivers: dict[int, weakref.ref] = {}
_thread = threading.local()
_lock = threading.Lock()


class _State:
    ok: bool | None = None  # whether `send` works (None: not checked yet)
    handler: Any = None  # the ctypes handler, kept alive for the life of the process
    next_id = 1


_state = _State()


# The leading fields of XLA_FFI_CallFrame (up to the end of its XLA_FFI_Args) and of
# XLA_FFI_Buffer, read with `struct` from raw memory (lighter than ctypes structure
# objects), in native byte order with a 64-bit platform's sizes and padding; elsewhere
# `available()` is False.
_FRAME = struct.Struct(
    "=QQQQi4xQQqQQ"
)  # struct_size, ext, api, ctx, stage, args: size, ext, n, types, args
_BUFFER = struct.Struct("=QQi4xQqQ")  # struct_size, ext, dtype, data, rank, dims
_INT, _PTR = struct.Struct("=i"), struct.Struct("=Q")
_LAYOUT_OK = C.sizeof(C.c_void_p) == C.sizeof(C.c_size_t) == 8


def _handler(frame: int) -> None:
    """The FFI handler: never raises (an exception here could not reach the user)."""
    try:
        if not getattr(_thread, "pinned", False):
            _pin_thread_state()
        # XLA's struct_size counts up to the end of a struct's last field (no padding):
        # anything smaller than the fields read here is a layout this module doesn't know.
        size, ext, _, _, stage, _, _, nargs, types, args = _FRAME.unpack(
            C.string_at(frame, _FRAME.size)
        )
        if size < _FRAME.size:
            return None
        if ext:
            _answer_metadata(ext)
            return None
        if (
            stage != _STAGE_EXECUTE
            or nargs != 1
            or _INT.unpack(C.string_at(types, 4))[0] != _ARG_BUFFER
        ):
            return None
        buf = _PTR.unpack(C.string_at(args, 8))[0]
        bsize, _, dtype, data, rank, dims = _BUFFER.unpack(C.string_at(buf, _BUFFER.size))
        if bsize < _BUFFER.size or dtype != _S32:
            return None
        count = 1
        for d in struct.unpack(f"={rank}q", C.string_at(dims, 8 * rank)):
            count *= d
        values = struct.unpack(f"={count}i", C.string_at(data, 4 * count))
        ref = _receivers.get(values[0])
        receiver = ref() if ref is not None else None
        if receiver is not None:
            receiver(values[1:])
    except BaseException:  # noqa: BLE001 - the receiver keeps its own errors
        pass
    return None


def _pin_thread_state() -> None:
    """Keep this (XLA-owned) thread's Python thread state between calls.

    ctypes wraps each call in PyGILState_Ensure/Release, which on a thread Python did not
    start creates and destroys a thread state every time (a cost on every notification: see
    docs/internals/jax.md).
    One Ensure that is never released keeps it, like a thread Python started itself.
    """
    ensure = C.pythonapi.PyGILState_Ensure
    ensure.restype = C.c_int
    ensure()
    _thread.pinned = True


def _answer_metadata(ext: int) -> None:
    """Registration asks, through an extension of the call frame, which API we speak."""
    base = _ExtBase.from_address(ext)
    if base.type != _EXT_METADATA:
        return
    md = C.cast(ext, C.POINTER(_MetadataExt)).contents.metadata.contents
    if md.struct_size >= _Metadata.traits.offset + C.sizeof(C.c_uint32):
        md.api_version.major_version = _API_MAJOR
        md.api_version.minor_version = _API_MINOR
        md.traits = 0


def available() -> bool:
    """Whether `send` works here (registered and checked once per process, on CPU only)."""
    with _lock:
        if _state.ok is None:
            _state.ok = _setup()
        return _state.ok


def _setup() -> bool:
    try:
        import jax
        import jax.numpy as jnp

        if not _LAYOUT_OK or jax.default_backend() != "cpu":
            return False
        proto = C.CFUNCTYPE(C.c_void_p, C.c_void_p)
        _state.handler = proto(_handler)  # kept alive for the life of the process
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(_state.handler), platform="cpu")
        seen = []

        def probe(values):
            seen.append(list(values))

        rid = _new_id(probe)

        def emit(v):
            send(rid, v)
            return v

        jax.block_until_ready(jax.jit(emit)(jnp.arange(3, dtype=jnp.int32)))
        return seen == [[0, 1, 2]]
    except Exception:  # noqa: BLE001 - any failure means: use jax.debug.callback
        return False


def _new_id(receiver: Callable[[tuple], None]) -> int:
    rid = _state.next_id
    _state.next_id += 1
    _receivers[rid] = (
        weakref.WeakMethod(receiver) if hasattr(receiver, "__self__") else weakref.ref(receiver)
    )
    return rid


def register(receiver: Callable[[tuple], None]) -> int | None:
    """An id under which ``send`` reaches ``receiver`` (held weakly: a bound method lives as
    long as its object), or None where `send` is unavailable."""
    if not available():
        return None
    with _lock:
        return _new_id(receiver)


def send(rid: int, values: Any) -> None:
    """Inside a jitted program: hand ``values`` (int32, any shape) to receiver ``rid``
    (as a flat tuple of Python ints)."""
    import jax
    import jax.numpy as jnp

    packed = jnp.concatenate([jnp.full((1,), rid, jnp.int32), jnp.ravel(values).astype(jnp.int32)])
    jax.ffi.ffi_call(_TARGET, (), has_side_effect=True)(packed)
