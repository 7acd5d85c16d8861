"""The few CUDA driver calls a copy-engine channel needs, through ctypes on libcuda.

Raw device memory shared between processes (IPC handles), copies between GPUs on the copy engines, and 32-bit
flags that a stream waits on or writes, so that neither an SM nor a host thread waits for a transfer.

torch exposes none of these for memory another process owns. Every call runs in the calling thread's current
context, which torch makes the device's primary context (call after torch.cuda.set_device and one CUDA op)."""
from __future__ import annotations

import ctypes
from functools import cache

IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*addr - value) >= 0, a comparison that wraps


class DriverError(RuntimeError):
    pass


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]  # bytes, NULs included


@cache
def _lib() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise DriverError(f"the CUDA driver library libcuda.so.1 could not be loaded: {e}") from None


def _call(name: str, *args: object) -> None:
    fn = getattr(_lib(), name)
    res = fn(*args)
    if res != 0:
        msg = ctypes.c_char_p()
        _lib().cuGetErrorString(res, ctypes.byref(msg))
        raise DriverError(f"{name} failed: CUDA error {res} ({(msg.value or b'?').decode()})")


def alloc(nbytes: int, *, zero: bool = False) -> int:
    """Device memory of its own allocation (never part of torch's cache, so its IPC handle covers it alone).
    `zero`: zeroed and the device synchronised, before any stream may use it."""
    ptr = ctypes.c_uint64()
    _call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    if zero:
        _call("cuMemsetD8_v2", ptr, ctypes.c_ubyte(0), ctypes.c_size_t(nbytes))
        _call("cuCtxSynchronize")
    return ptr.value


def free(ptr: int) -> None:
    _call("cuMemFree_v2", ctypes.c_uint64(ptr))


def ipc_handle(ptr: int) -> bytes:
    h = _IpcHandle()
    _call("cuIpcGetMemHandle", ctypes.byref(h), ctypes.c_uint64(ptr))
    return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES)


def ipc_open(handle: bytes) -> int:
    """Map another process's allocation into this context (peer access enabled as needed); returns its address."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise DriverError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, found {len(handle)}")
    h = _IpcHandle.from_buffer_copy(handle)
    ptr = ctypes.c_uint64()
    _call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), h, ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS))
    return ptr.value


def ipc_close(ptr: int) -> None:
    _call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))


def copy(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Copy `nbytes` on `stream`; between GPUs (an address ipc_open returned) the copy engines move it."""
    _call("cuMemcpyDtoDAsync_v2", ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes),
          ctypes.c_void_p(stream))


def wait_at_least(stream: int, addr: int, value: int) -> None:
    """`stream` runs nothing after this until the 32-bit flag at `addr` reaches `value` (cyclic comparison)."""
    _call("cuStreamWaitValue32_v2", ctypes.c_void_p(stream), ctypes.c_uint64(addr),
          ctypes.c_uint32(value & 0xFFFFFFFF), ctypes.c_uint(_WAIT_GEQ))


def write(stream: int, addr: int, value: int) -> None:
    """Write the 32-bit flag at `addr` once everything before it on `stream` is done (and visible)."""
    _call("cuStreamWriteValue32_v2", ctypes.c_void_p(stream), ctypes.c_uint64(addr),
          ctypes.c_uint32(value & 0xFFFFFFFF), ctypes.c_uint(0))
