"""Prepared weights in one file that every engine on the machine maps read-only, so the page cache holds one copy
of them however many engines a server runs (as llama.cpp maps its GGUF).

The file holds what ``model.prepare_weights`` gives: every tensor the forward reads, each projection in the layout
chosen for this CPU, or quantized. Its name is a hash of what the contents depend on: the checkpoint (its files'
names, sizes and modification times, the GGUF's blocks included), the dtype, the quantization, the layout (and the
version of the quantized formats' held bytes) and the C library (its sources, flags and this CPU's features), so
any change gives a new file, built at the next load. It is built once, under a lock, and written under a temporary
name then renamed: engines loading at once (a server's models) wait for the first and map the same file, never two.
Building a file deletes those of the same folder's older keys and those whose folder is gone; deleting
``$XDG_CACHE_HOME/llm-batching-triton/weights`` is safe whenever no engine is loading.

Weights the C kernels do not read (CUDA, float32 in oneDNN's blocked layout, no C compiler) are prepared in the
process, as before; ``LLM_WEIGHT_FILE=0`` asks for that everywhere.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from backend.contract.settings import WEIGHT_FILE_ENV_VAR
from backend.engine.config import GGUF_BLOCKS
from backend.engine.linear import Layout, Linear, c_layout
from backend.kernels import cpu_kernels, quantized_linear
from backend.kernels.weight_format import WeightFormat

log = logging.getLogger(__name__)

Prepared = dict[str, "torch.Tensor | Linear"]  # model.prepare_weights's result: what the forward reads, by name

_FORMAT = b"llm-batching-triton prepared weights 1"
_ALIGN = 4096  # each tensor starts on its own page
# plain memory: a file holds them as they are
_STORED_LAYOUTS = (Layout.PACKED, Layout.ROW_MAJOR, Layout.PLAIN, Layout.Q4_1, Layout.Q8_0, Layout.INT8)


def gguf_blocks(model_dir: Path) -> dict[str, tuple[WeightFormat, torch.Tensor]] | None:
    """The GGUF's quantized tensors kept beside the checkpoint, by name: (format, uint8 blocks); None if none."""
    path = model_dir / GGUF_BLOCKS
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        formats = f.metadata() or {}
        return {name: (WeightFormat(formats[name]), f.get_tensor(name)) for name in f.keys() if name in formats}


def prepared_weights(model_dir: Path, dtype: torch.dtype, device: torch.device,
                     prepare: Callable[[], Prepared], quantization: WeightFormat | None = None) -> Prepared:
    """What ``prepare()`` returns, mapped from the file of prepared weights for this key (built first if there is
    none yet); ``prepare()`` itself where the weights cannot live in a file."""
    if (device.type != "cpu" or dtype != torch.bfloat16 or cpu_kernels.load() is None
            or os.environ.get(WEIGHT_FILE_ENV_VAR, "1") == "0"):
        return prepare()  # weights the C kernels do not read: oneDNN's layout (float32), CUDA, no compiler
    path = weights_path(model_dir, dtype, quantization)
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(path.with_suffix(".lock"), "w")
        except OSError as exc:  # e.g. a read-only cache: this engine keeps its own copy
            log.warning("prepared weights kept in this process, no file for them: %s", exc)
            return prepare()
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even if this process dies
            if not path.exists():  # another engine may have built it while this one waited
                prepared = prepare()
                if not all(_storable(value) for value in prepared.values()):
                    return prepared
                try:
                    _write(path, prepared, model_dir.resolve())
                except OSError as exc:  # e.g. the disk is full
                    log.warning("prepared weights kept in this process, none written to %s: %s", path, exc)
                    return prepared
                del prepared
                _release_freed_heap()
                _remove_stale(path)
    return read(path)


def weights_path(model_dir: Path, dtype: torch.dtype, quantization: WeightFormat | None = None) -> Path:
    """The file for this checkpoint, dtype, quantization, layout and CPU (what its name hashes is in the module's
    docstring)."""
    model_dir = model_dir.resolve()
    parts = [_FORMAT, str(model_dir).encode(), str(dtype).encode(), c_layout().value.encode(),
             (cpu_kernels.library_key() or "no C kernels").encode(), str(quantization).encode(),
             f"held layout {quantized_linear.HELD_LAYOUT_VERSION}".encode()]
    for f in sorted([*model_dir.iterdir(), *(model_dir / GGUF_BLOCKS.parent).glob("*")]):
        if f.suffix in (".safetensors", ".json"):
            stat = f.stat()
            parts.append(f"{f.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]
    # the part _remove_stale keeps to: one file per folder, dtype and quantization
    folder = hashlib.sha256(f"{model_dir} {dtype}{f' {quantization}' if quantization else ''}".encode()).hexdigest()[:8]
    return cpu_kernels.cache_dir() / "weights" / f"{model_dir.name}-{folder}-{key}.bin"


def _remove_stale(path: Path) -> None:
    """Delete the files of this folder and dtype's earlier keys (the checkpoint's or the code's older versions), and
    those whose checkpoint folder is gone (a test's temporary model): an engine still mapping one keeps its pages
    until it lets go."""
    prefix = path.name[: path.name.rindex("-") + 1]
    for old in path.parent.glob("*.bin"):
        if old.name != path.name and (old.name.startswith(prefix) or not _folder_exists(old)):
            old.unlink(missing_ok=True)
            old.with_suffix(".lock").unlink(missing_ok=True)


def _folder_exists(path: Path) -> bool:
    """Whether the checkpoint folder a file of prepared weights was made from is still there (its index says)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            return Path(json.loads(f.read(length))["model"]).exists()
    except (OSError, ValueError, KeyError, struct.error):
        return False


def _storable(value: torch.Tensor | Linear) -> bool:
    tensors = [value] if isinstance(value, torch.Tensor) else [value.weight, value.bias]
    return ((isinstance(value, torch.Tensor) or value.layout in _STORED_LAYOUTS)
            and all(t is None or (t.device.type == "cpu" and t.layout == torch.strided) for t in tensors))


def _write(path: Path, prepared: Prepared, model_dir: Path) -> None:
    """[8 bytes: the index's length][the index, JSON][each tensor's bytes, page-aligned], written aside and renamed."""
    index, blobs, offset = {}, [], 0

    def place(t: torch.Tensor) -> dict:
        nonlocal offset
        t = t.contiguous()
        entry = {"offset": offset, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        blobs.append((offset, t))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        return entry

    for name, value in prepared.items():
        if isinstance(value, torch.Tensor):
            index[name] = place(value)
        else:
            index[name] = {"weight": place(value.weight), "layout": value.layout.value,
                           "bias": None if value.bias is None else place(value.bias)}
    header = json.dumps({"format": _FORMAT.decode(), "model": str(model_dir), "tensors": index}).encode()
    start = -(-(8 + len(header)) // _ALIGN) * _ALIGN
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
        try:
            f.write(struct.pack("<Q", len(header)) + header)
            for where, t in blobs:
                f.seek(start + where)
                f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            f.truncate(start + offset)
            f.flush()
            os.fsync(f.fileno())
            # NOTE: the writes left the file in the page cache as small pages; dropped (clean after the fsync), it
            # is read back by the first engine that maps it as read() asks, in 2 MiB pages (_map_huge).
            if hasattr(os, "posix_fadvise"):  # not on macOS
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            os.fchmod(f.fileno(), 0o644)  # readable by any engine, as the lock and the library are
        except BaseException:
            os.unlink(f.name)
            raise
    os.replace(f.name, path)


def read(path: Path) -> Prepared:
    """The prepared weights as views into a read-only, shared mapping of ``path``."""
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # MAP_SHARED, PROT_READ: the page cache's pages
    _map_huge(mapping)
    (length,) = struct.unpack("<Q", mapping[:8])
    meta = json.loads(mapping[8 : 8 + length])
    if meta["format"] != _FORMAT.decode():
        raise ValueError(f"{path} is not a file of prepared weights in this format")
    start = -(-(8 + length) // _ALIGN) * _ALIGN
    with warnings.catch_warnings():  # the buffer is read-only, and so is every use the engine makes of it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        data = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it

    def view(entry: dict) -> torch.Tensor:
        dtype = getattr(torch, entry["dtype"])  # torch's own name for it, as _write gave it
        count = 1
        for size in entry["shape"]:
            count *= size
        at = start + entry["offset"]
        return data[at : at + count * dtype.itemsize].view(dtype).view(entry["shape"])

    prepared: Prepared = {}
    for name, entry in meta["tensors"].items():
        if "layout" in entry:
            bias = None if entry["bias"] is None else view(entry["bias"])
            prepared[name] = Linear(view(entry["weight"]), bias, Layout(entry["layout"]))
        else:
            prepared[name] = view(entry)
    return prepared


def _map_huge(mapping: mmap.mmap) -> None:
    """Ask for the mapping in 2 MiB pages where the kernel reads files into them (Linux with transparent huge pages,
    a filesystem with large folios: ext4, xfs): pages read from disk from now on come in 2 MiB folios, each mapped
    by one TLB entry. A decode step streams every weight once: in 4 KiB pages that is a TLB miss every 4 KiB, and
    the hardware prefetchers stop at each page's end (on Zen 4 the step's projections streamed 10-30 % faster from
    2 MiB pages). Pages already cached in small folios stay small until evicted; elsewhere it does nothing."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:  # e.g. a kernel without transparent huge pages
            pass


def _release_freed_heap() -> None:
    """Hand the in-process copy just freed back to the system: the engine keeps freed memory for reuse
    (``model_runner``'s malloc settings), and this one it will not reuse."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back
        pass
