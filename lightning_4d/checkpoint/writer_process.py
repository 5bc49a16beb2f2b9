"""One rank's checkpoint shards written by a process of its own, from host memory it shares with training.

Why a process: DCP's file writer serializes every tensor while holding the GIL (``torch.save`` into the file, its
bytes copied through Python: 0.5 s of GIL-held time per 0.5 GB, ``docs/performance-history.md``). In a thread
of the training process that time is taken from training whenever training returns from a collective and needs the
GIL back; tp and pp steps return from many. A process has a GIL of its own, runs at nice +10, and dies with its
rank (``PR_SET_PDEATHSIG`` on Linux; elsewhere at the end of its current write). Not in the idle scheduling
class: on a machine whose cores training fills, a write there gets so little time that the next save waits for
it (``docs/performance.md``).

Only DCP's data-writing phase runs here. Planning, the gather of every rank's write results and the index stay
in the training process's writer thread, over its process group (:mod:`.writer`). The staging buffer is one
block of shared memory (an anonymous ``memfd`` on Linux), handed to the process once per allocation; each save
sends the plan and, per tensor, where it lies in that block. This file imports only torch and the standard
library: the process runs it by path, without importing the package (or the user's script).
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import zlib
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future
from torch.utils.serialization import config as serialization_config

# The writer's nice value above training's: where training keeps every core busy (CPU-only machines), the writer
# takes about a tenth of a core's time from it (CFS weights 1024 against 110), and all of what training leaves idle
# (collectives' waits, a GPU's kernels).
WRITER_NICENESS = 10
ALIGNMENT = 64  # bytes; every staged tensor starts on a cache line

_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


def fingerprint(file: Any) -> dict[str, Any]:
    """A file's size and CRC-32, as ``checksums.json`` records them (:mod:`.integrity`), read through a memory map:
    no copy of the file into the process. Here, not in :mod:`.integrity`, because the writer process runs this
    file alone, and it checksums what it wrote."""
    size, crc = os.stat(file).st_size, 0
    if size:
        with open(file, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            crc = zlib.crc32(mapped)
    return {"size": size, "crc32": f"{crc:08x}"}


def _send(connection: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    connection.sendall(len(data).to_bytes(8, "little") + data)


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = connection.recv(min(left, 1 << 20))
        if not part:
            raise EOFError("the other end closed the connection")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _receive(connection: socket.socket) -> Any:
    return pickle.loads(_receive_exactly(connection, int.from_bytes(_receive_exactly(connection, 8), "little")))


def _map(fd: int, size: int) -> torch.Tensor:
    """The shared block behind ``fd`` as bytes (both processes write and read the same pages)."""
    folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    return torch.from_file(f"{folder}/{fd}", shared=True, size=size, dtype=torch.uint8)


def _new_block(size: int) -> int:
    """An unnamed file in memory: nothing to clean up after a crash."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("lightning-4d-staging")
    else:
        fd, name = tempfile.mkstemp(prefix="lightning-4d-staging-")
        os.unlink(name)
    os.ftruncate(fd, size)
    return fd


class SharedBlock:
    """Host memory for one rank's staged tensors: one block, carved into aligned views by :meth:`view`.
    ``pinned``: page-locked for asynchronous copies from a CUDA device, as torch pins the shared memory of its
    own asynchronous save."""

    def __init__(self, size: int, pinned: bool = False) -> None:
        self.size, self.pinned = max(size, ALIGNMENT), pinned
        self.fd = _new_block(self.size)
        self.bytes = _map(self.fd, self.size)
        self._used = 0
        if pinned:
            code = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.size, 0)
            if code != 0:
                raise RuntimeError(f"cudaHostRegister of a {self.size}-byte staging block failed with code {code}")

    def view(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        count = shape.numel()
        end = start + count * dtype.itemsize
        if end > self.size:
            raise ValueError(f"staging block of {self.size} bytes is too small for another {tuple(shape)} {dtype}")
        self._used = end
        return self.bytes[start:end].view(dtype).view(shape)

    def offset(self, tensor: torch.Tensor) -> Optional[int]:
        """Where ``tensor``'s first element lies in the block, or None when it lies elsewhere."""
        start = self.bytes.data_ptr()
        if tensor.device.type != "cpu" or not start <= tensor.data_ptr() < start + self.size:
            return None
        return tensor.data_ptr() - start

    @staticmethod
    def bytes_for(tensors: list[torch.Tensor]) -> int:
        return sum(-(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT for t in tensors)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
        self.bytes = None
        os.close(self.fd)


class WriterProcess:
    """The training process's handle on its writer process. Start it from the training thread: on Linux the
    process dies when the thread that started it ends."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self._connection = ours
        self._lock = threading.Lock()
        self._block: Optional[SharedBlock] = None
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, os.path.abspath(__file__), str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()

    def share(self, block: SharedBlock) -> None:
        """The block the next writes read from (sent once per allocation)."""
        with self._lock:
            self._ask(("block", block.size), fds=[block.fd])
            self._block = block

    def write(self, path: str, plan: Any, items: list[tuple], sync_files: bool) -> tuple[list[Any], dict[str, Any]]:
        """DCP's write results for ``plan`` and the :func:`fingerprint` of every file written, by name; ``items``
        are :func:`describe`'s, in the plan's order."""
        with self._lock:
            return self._ask(("write", path, plan, items, sync_files))

    def describe(self, data: Any) -> tuple:
        """A resolved write item: its place in the shared block, or (anything else) its value."""
        if isinstance(data, torch.Tensor) and self._block is not None:
            offset = self._block.offset(data)
            if offset is not None and offset % data.element_size() == 0:
                return ("shared", data.dtype, offset // data.element_size(), tuple(data.shape), data.stride())
        return ("value", data)

    def _ask(self, message: tuple, fds: Optional[list[int]] = None) -> Any:
        try:
            _send(self._connection, message)
            if fds:
                socket.send_fds(self._connection, [b"f"], fds)
            kind, answer = _receive(self._connection)
        except (EOFError, OSError) as error:
            raise RuntimeError(f"the checkpoint writer process (pid {self.process.pid}) ended"
                               f" (exit code {self.process.poll()})") from error
        if kind == "failed":
            raise RuntimeError(f"the checkpoint writer process failed:\n{answer}")
        return answer

    def close(self) -> None:
        """The process ends once it reads the end of the connection."""
        self._connection.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


class ProcessFileWriter(FileSystemWriter):
    """DCP's file writer (same files, same index) whose data-writing phase runs in a :class:`WriterProcess`.
    ``fingerprints``: the files it wrote, checksummed by the process right after writing them."""

    def __init__(self, path: Any, process: WriterProcess) -> None:
        super().__init__(path)
        self.writer_process = process
        self.fingerprints: dict[str, Any] = {}

    def write_data(self, plan: Any, planner: Any) -> Future:
        items = [self.writer_process.describe(planner.resolve_data(item)) for item in plan.items]
        results, self.fingerprints = self.writer_process.write(str(self.path), plan, items, self.sync_files)
        future: Future = Future()
        future.set_result(results)
        return future


class _Resolved:
    """What DCP's writer asks its planner for, answered from the shared block."""

    def __init__(self, plan: Any, items: list[tuple], block: Any) -> None:
        self._data = {id(item): self._rebuild(described, block) for item, described in zip(plan.items, items)}

    @staticmethod
    def _rebuild(described: tuple, block: Any) -> Any:
        """A tensor over exactly its own bytes of the block (DCP's writer copies a tensor whose storage is larger
        than it before serializing it)."""
        if described[0] == "value":
            return described[1]
        _, dtype, offset, shape, stride = described
        count = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
        flat = torch.frombuffer(block, dtype=dtype, count=count, offset=offset * dtype.itemsize) if count else \
            torch.empty(0, dtype=dtype)
        return flat.as_strided(shape, stride)

    def resolve_data(self, item: Any) -> Any:
        return self._data[id(item)]


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)


def _serve(fd: int, parent: int) -> None:
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops training; the save in flight still completes
    os.nice(WRITER_NICENESS)
    torch.set_num_threads(1)
    # torch.save's own CRC-32 of each record, a pass over every byte, is not needed: the files' checksums
    # (``fingerprint``) cover them, and loading reads records whose CRC is not recorded as it reads the others.
    serialization_config.save.compute_crc32 = False
    connection = socket.socket(fileno=fd)
    block: Optional[mmap.mmap] = None
    while True:
        try:
            message = _receive(connection)
        except EOFError:
            return
        try:
            if message[0] == "block":
                _, received, _, _ = socket.recv_fds(connection, 1, 1)
                block = mmap.mmap(received[0], message[1])  # the writer's view of the training process's block
                os.close(received[0])
                answer: Any = None
            else:
                _, path, plan, items, sync_files = message
                writer = FileSystemWriter(path, sync_files=sync_files)
                results = writer.write_data(plan, _Resolved(plan, items, block)).wait()
                written = sorted({result.storage_data.relative_path for result in results})
                answer = (results, {name: fingerprint(os.path.join(path, name)) for name in written})
            _send(connection, ("done", answer))
        except Exception:  # noqa: BLE001  sent back and raised in the training process
            _send(connection, ("failed", traceback.format_exc()))


if __name__ == "__main__":
    _serve(int(sys.argv[2]), int(sys.argv[3]))
