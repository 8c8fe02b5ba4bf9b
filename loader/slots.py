"""Batch buffers shared between the producer process and the trainer: one ``memfd`` per slot,
mapped by both. The producer assembles a batch straight into a free slot; the trainer lends the
slot's arrays to MXNet without a copy (``loader.zerocopy``) and gives the slot back once MXNet
gave it back (every array and view dropped, every pending operation on it done).

A slot's file descriptor travels once, with the first batch in it (``SCM_RIGHTS``); after that a
batch message names the slot by number. The producer reuses a slot that is neither out with the
trainer (sent, not given back) nor referred to in the producer (a batch queued there, perhaps for
an epoch that was cut short and whose queue was dropped). A trainer that keeps every batch of an
epoch (``list(it)``) makes the producer open new slots, as the in-process ``Arena`` allocates new
buffers then.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
from typing import Optional

import numpy as np

from .memory import Arena
from .zerocopy import Loan, lend

__all__ = ["SlotArena", "SlotMaps"]


def _map(fd: int, floats: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(fd, floats * 4), np.float32, floats)


class SlotArena(Arena):
    """The producer's side: batch buffers are slots; ``hand_out`` returns the buffer itself."""

    def __init__(self, schema, batch_floats: int, keep: int):
        super().__init__(schema, batch_floats, keep)
        self.slots: list[np.ndarray] = []
        self.fds: list[int] = []
        self._out: set[int] = set()  # sent to the trainer, not given back
        self._number: dict[int, int] = {}  # buffer address -> slot number
        self._announced: set[int] = set()

    def batch(self) -> np.ndarray:
        with self._lock:
            for number in range(len(self.slots)):
                # References: the list and getrefcount's argument; more while a batch holds it.
                if number not in self._out and sys.getrefcount(self.slots[number]) <= 2:
                    return self.slots[number]
            fd = os.memfd_create("shardgen-batch", getattr(os, "MFD_CLOEXEC", 0))
            os.ftruncate(fd, self.batch_floats * 4)
            array = _map(fd, self.batch_floats)
            self._number[array.ctypes.data] = len(self.slots)
            self.slots.append(array)
            self.fds.append(fd)
            return array

    @staticmethod
    def hand_out(flat: np.ndarray, views: list) -> list:
        return [flat]

    def announce(self, flat: np.ndarray) -> tuple[int, list[int]]:
        """The slot number of a batch buffer, and its descriptor if the trainer has not seen it."""
        with self._lock:
            number = self._number[flat.ctypes.data]
            self._out.add(number)
            if number in self._announced:
                return number, []
            self._announced.add(number)
            return number, [self.fds[number]]

    def give_back_slots(self, numbers: list[int]) -> None:
        with self._lock:
            self._out.difference_update(numbers)

    def close(self) -> None:
        with self._lock:
            for fd in self.fds:
                os.close(fd)
            self.fds = []


class SlotMaps:
    """The trainer's side: the slots it has mapped, and which of them it still holds."""

    def __init__(self, floats: int, views: list):
        self.floats, self.views = floats, views
        self.arrays: dict[int, np.ndarray] = {}
        self.loans: dict[int, Optional[Loan]] = {}
        self.held: set[int] = set()
        self.lock = threading.Lock()

    def add(self, number: int, fds: list[int]) -> None:
        for fd in fds:
            try:
                self.arrays[number] = _map(fd, self.floats)
            finally:
                os.close(fd)

    def wrap(self, number: int) -> list:
        """The batch in slot ``number`` as MXNet arrays (no copy)."""
        flat = self.arrays[number]
        with self.lock:
            self.held.add(number)
            self.loans[number], arrays = lend(flat, self.views, self.loans.get(number))
        return arrays

    def released(self, keep: Optional[int] = None) -> list[int]:
        """Held slots nothing refers to any more (but ``keep``): the producer may reuse them."""
        with self.lock:
            # A loan MXNet gave back; else (from_numpy) the references: the dict, the argument.
            done = [n for n in self.held if n != keep and (not self.loans[n].out if self.loans.get(n) is not None
                                                           else sys.getrefcount(self.arrays[n]) <= 2)]
            self.held.difference_update(done)
        return done
