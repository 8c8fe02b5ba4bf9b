"""Lending a numpy buffer to MXNet without a copy, and knowing when MXNet gave it back, without
running Python when it does.

``mx.nd.from_numpy`` frees its arrays through a Python callback. MXNet calls it from an engine
thread when the last array of a chunk is gone, so every batch the trainer drops makes that thread
take the trainer's GIL: about 150 us of the trainer's time per batch here (GIL hand-offs), and a
wait of up to a switch interval when the GIL is busy.

A ``Loan`` hands MXNet one ``DLManagedTensor`` per array of a buffer (``MXNDArrayFromDLPackEx``
with a handle MXNet keeps: no copy of the descriptor). Its deleter is a C function, libc's
``pthread_spin_unlock``, which only stores its unlocked value (0, or 1 on x86) in the first 4
bytes of the descriptor it is given: the low half of ``dl_tensor.data``. MXNet calls it once the
engine is done with the chunk (every array and view of it gone, every pending operation on it
finished), so a descriptor whose data field no longer holds the buffer's address is one MXNet
gave back. Where libc has no such function a Python deleter stores 0 (the old cost, same
protocol).

The descriptors live as long as a loan is out: loans not yet given back are kept in a module
registry, so a loan survives its iterator while the caller still holds the batch.

The arrays lent are ``LentNDArray``s: MXNet's arrays whose handle the trainer never frees itself.
Dropping one only queues its handle (a ``deque.append``); the next ``lend()`` (the producer's,
once a batch) or a look at whether a loan is out frees the queued handles. MXNet's own free is a
ctypes call that releases the GIL (4 a batch: each a chance for the producer thread to take it
until its next release, in the middle of the trainer's ``next()``), and freeing a chunk's last
handle pushes its deletion to the engine: ~13 us a batch on the trainer's thread, 2-3 times that
just after it woke from a GPU step. A trainer that drops arrays with no producer lending (its
iterator closed) frees them at once, and any thread past ``_PENDING_MAX`` handles. Freeing never waits.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from typing import Optional

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call
from mxnet.ndarray.ndarray import DeleterFunc, DLContext, DLDataType, DLManagedTensor

__all__ = ["Loan", "LentNDArray", "lend", "give_back_available", "outstanding", "free_pending", "lenders", "sweep"]

_LOW = 0xFFFFFFFF
_FLOAT32 = DLDataType(*DLDataType.TYPE_MAP["float32"])


def _c_deleter() -> tuple[DeleterFunc, bool]:
    """The deleter: libc's ``pthread_spin_unlock`` (a release store of its unlocked value, 0, or 1
    on x86), else a Python one."""
    for name in (None, "libc.so.6", "libpthread.so.0"):
        try:
            fn = ctypes.CDLL(name).pthread_spin_unlock
        except (OSError, AttributeError):
            continue
        return DeleterFunc(ctypes.cast(fn, ctypes.c_void_p).value), True
    return DeleterFunc(_python_deleter), False


def _python_deleter(tensor) -> None:  # the same store, for a libc without pthread spinlocks
    ctypes.c_uint32.from_address(ctypes.addressof(tensor.contents)).value = 0


_DELETER, _NATIVE = _c_deleter()
# MXNDArrayFree called with the GIL held (PyDLL: the same library, loaded already).
_FREE_HOLDING_GIL = ctypes.PyDLL(_LIB._name).MXNDArrayFree
_FREE_HOLDING_GIL.argtypes = [ctypes.c_void_p]
_OUT: set = set()  # loans MXNet holds: their descriptors must outlive its deleter call
_OUT_LOCK = threading.Lock()
_PENDING: collections.deque = collections.deque()  # handles of dropped LentNDArrays, not freed yet
_PENDING_MAX = 64  # past this many, the thread that drops one frees them all (16 batches' arrays)
_LENDERS = [0]  # open lenders (iterators whose producer lends); with none, a dropped array is freed at once


def lenders(delta: int) -> None:
    """A lender (an iterator's producer side) opens (+1) or closes (-1)."""
    with _OUT_LOCK:
        _LENDERS[0] += delta


def free_pending(_pending=_PENDING, _free=_LIB.MXNDArrayFree, _check=check_call) -> None:  # noqa: B008
    """Free the handles of dropped arrays (any thread; the default free lets go of the GIL)."""
    while _pending:
        try:
            handle = _pending.popleft()
        except IndexError:  # another thread took the last one
            return
        _check(_free(handle))


class LentNDArray(mx.nd.NDArray):
    """An MXNet array over a lent buffer (or a view of one: MXNet makes views of ``self.__class__``);
    dropping it queues its handle, freed by the next ``lend()`` (see the module docstring)."""

    __slots__: list = []

    def __del__(self, _pending=_PENDING, _max=_PENDING_MAX, _lenders=_LENDERS,  # noqa: B008 (bound at exit too)
                _drain=free_pending, _free=_FREE_HOLDING_GIL) -> None:
        _pending.append(self.handle)  # atomic, safe in any thread and under any lock
        if len(_pending) > _max or _lenders[0] <= 0:  # nobody lends (soon): free here, keeping the GIL
            _drain(_pending, _free)


_LENDS = [0]  # lends since the last sweep of _OUT (a sweep every max(64, len(_OUT)) lends: O(1) each)


def outstanding() -> int:
    """Loans MXNet still holds (the registry swept first)."""
    sweep()
    return len(_OUT)


def sweep() -> None:
    """Free dropped arrays' handles, and drop the loans MXNet gave back from the registry (their
    buffers may go)."""
    free_pending()
    with _OUT_LOCK:
        loans, _LENDS[0] = list(_OUT), 0
    for loan in loans:
        loan._refresh()


def give_back_available() -> bool:
    """Whether MXNet gives buffers back without running Python (libc's deleter)."""
    return _NATIVE


class Loan:
    """The MXNet arrays ``views`` ``(start, stop, shape)`` of the float32 buffer ``flat``."""

    def __init__(self, flat: np.ndarray, views: list):
        if flat.dtype != np.float32 or not flat.flags.c_contiguous:
            raise ValueError("a loan needs a contiguous float32 buffer")
        self.flat, self.views = flat, list(views)
        self._tensors, self._shapes, self._addresses = [], [], []
        base = flat.ctypes.data
        for a, _z, shape in views:
            address = base + 4 * a
            if address & _LOW == 0:  # could not be told from a given-back descriptor: see lend()
                raise ValueError("an array address with a zero low half")
            dims = (ctypes.c_int64 * len(shape))(*shape)
            t = DLManagedTensor()
            t.dl_tensor.ctx = DLContext(1, 0)
            t.dl_tensor.ndim = len(shape)
            t.dl_tensor.dtype = _FLOAT32
            t.dl_tensor.shape = dims
            t.dl_tensor.strides = None
            t.dl_tensor.byte_offset = 0
            t.dl_tensor.data = None  # set when lent; MXNet zeroes its low half when it gives it back
            t.deleter = _DELETER
            self._tensors.append(t)
            self._shapes.append(dims)
            self._addresses.append(address)
        self._out = False
        self._lock = threading.Lock()  # lending and judging it given back, one at a time

    @property
    def out(self) -> bool:
        """Lent and not yet given back by MXNet."""
        return self._refresh()

    def _given_back(self) -> bool:
        """Every descriptor no longer holds the address it was lent with (under ``_lock``)."""
        return all(t.dl_tensor.data != a for t, a in zip(self._tensors, self._addresses))

    def _refresh(self) -> bool:
        free_pending()  # arrays dropped since the last lend: their chunks may be this loan's
        with self._lock:  # atomic with lend(): a judgement of the last lending never ends a new one
            if self._out and self._given_back():
                self._out = False
                with _OUT_LOCK:
                    _OUT.discard(self)
            return self._out

    def lend(self) -> list:
        """The arrays, as new MXNet arrays over the buffer (the loan must not be out)."""
        free_pending()
        with self._lock:
            if self._out and not self._given_back():
                raise RuntimeError("this buffer is still lent to MXNet")
            arrays = []
            for t, a in zip(self._tensors, self._addresses):
                handle = ctypes.c_void_p()
                t.dl_tensor.data = a
                try:
                    check_call(_LIB.MXNDArrayFromDLPackEx(ctypes.byref(t), False, ctypes.byref(handle)))
                except BaseException:
                    t.dl_tensor.data = None  # not lent
                    self._out = bool(arrays)  # those lent so far come back when dropped
                    with _OUT_LOCK:
                        (_OUT.add if arrays else _OUT.discard)(self)
                    raise
                arrays.append(LentNDArray(handle=handle))
            self._out = True
            with _OUT_LOCK:
                _OUT.add(self)
                _LENDS[0] += 1
                due = _LENDS[0] >= max(64, len(_OUT))
        if due:  # outside this loan's lock: a sweep takes every loan's in turn
            sweep()
        return arrays


def lend(flat: np.ndarray, views: list, loan: Optional[Loan] = None) -> tuple[Optional[Loan], list]:
    """The arrays ``views`` of ``flat`` lent to MXNet: through ``loan`` if it is ``flat``'s, else a
    new loan; through ``mx.nd.from_numpy`` in the (4 GiB aligned) case a loan cannot track."""
    if loan is None or loan.flat is not flat or loan.views != list(views):
        try:
            loan = Loan(flat, views)
        except ValueError:
            whole = mx.nd.from_numpy(flat, zero_copy=True)
            return None, [whole[a:z].reshape(shape) for a, z, shape in views]
    return loan, loan.lend()
