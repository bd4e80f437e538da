"""Where a figure came from: the code (commit, dirty tree), the date, the machine (CPU model and the instruction sets
that change the kernels' speed, cores, memory, a memory read bandwidth measured at the start) and the software.

A benchmark calls :func:`provenance` once, before it measures, and keeps the result in its record; the bandwidth is
measured then so that a reader can tell a slow run on a busy machine from a slow commit."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import re
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# The cpuinfo flags that choose a kernel path here (backend/kernels/cpu_kernels.py): AMX tiles on Intel, AVX-512 with
# BF16 dot products and VNNI on both vendors, AVX2 as the floor.
ISA_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx2")

# AMD's family/model numbers to the core's name (the model name of a virtual machine often says only "AMD EPYC").
_AMD_CORES = (
    (23, range(0x00, 0x30), "Zen"), (23, range(0x30, 0x100), "Zen 2"),
    (25, range(0x00, 0x10), "Zen 3"), (25, range(0x20, 0x60), "Zen 3"),
    (25, range(0x10, 0x20), "Zen 4"), (25, range(0x60, 0x80), "Zen 4"), (25, range(0xA0, 0xB0), "Zen 4"),
    (26, range(0x00, 0x100), "Zen 5"),
)

PACKAGES = ("torch", "transformers", "numpy", "triton", "tritonclient", "locust", "nvidia-pytriton")


def git_state(root: Path = REPO_ROOT) -> dict:
    """The commit and whether tracked files differ from it (untracked files do not count: reports land in the tree)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def cpuinfo(text: str | None = None) -> dict:
    """The first processor's entry of /proc/cpuinfo, as a dict of its fields."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def cpu(text: str | None = None) -> dict:
    info = cpuinfo(text)
    flags = set(info.get("flags", "").split())
    vendor = info.get("vendor_id", platform.processor() or platform.machine())
    family, model = _int(info.get("cpu family")), _int(info.get("model"))
    core = None
    if vendor == "AuthenticAMD" and family is not None and model is not None:
        core = next((name for f, models, name in _AMD_CORES if f == family and model in models), None)
    return {
        "model": info.get("model name", platform.processor() or platform.machine()),
        "vendor": vendor,
        "family": family,
        "model_number": model,
        "core": core,
        "isa": {flag: flag in flags for flag in ISA_FLAGS},
        "cpus": usable_cpus(),
    }


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def read_bandwidth_gbs(threads: int | None = None, num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """The best read bandwidth of ``threads`` threads (default: every usable CPU) summing a buffer far larger than
    any cache, in GB/s: decode reads every weight once a step, so this is the machine's ceiling for it at the time
    of the run (and ``make bench``'s memory floor)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or usable_cpus())
    try:
        buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
        buffer.sum()  # touch every page before timing
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return num_bytes / best / 1e9


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def provenance(measure_bandwidth: bool = True) -> dict:
    return {
        **git_state(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu(),
        "memory_gib": memory_gib(),
        "read_bandwidth_gbs": round(read_bandwidth_gbs(), 1) if measure_bandwidth else None,
        "os": f"{platform.system()} {platform.release()}",
        "versions": versions(),
    }


def cpu_slug(cpu_fields: dict) -> str:
    """How a kept record's file name names the CPU: its vendor's word and the line after it ('amd-epyc',
    'intel-xeon'), or the model name's first two words; '-avx2' after them for a CPU with AVX2 and no AVX-512, whose
    kernels are others (a virtual machine's 'AMD EPYC' is a Zen 2 as well as a Zen 4)."""
    words = re.sub(r"\((?:r|tm)\)", " ", cpu_fields.get("model") or "unknown cpu", flags=re.I).lower().split()
    start = next((i for i, word in enumerate(words) if word in ("amd", "intel")), 0)
    slug = "-".join(re.sub(r"[^a-z0-9]+", "", word) for word in words[start:start + 2]) or "unknown"
    isa = cpu_fields.get("isa", {})
    return f"{slug}-avx2" if isa.get("avx2") and not isa.get("avx512f") else slug


def cpu_label(cpu_fields: dict) -> str:
    """How a table names the CPU: 'AMD EPYC (Zen 4; AVX-512 BF16, VNNI; no AMX), 2 CPUs'."""
    isa = cpu_fields.get("isa", {})
    has = [name for flag, name in (("avx512_bf16", "AVX-512 BF16"), ("avx512_vnni", "VNNI")) if isa.get(flag)]
    if not isa.get("avx512f"):
        has = ["AVX2"] if isa.get("avx2") else []
    has.append("AMX" if isa.get("amx_tile") else "no AMX")
    core = f"{cpu_fields['core']}; " if cpu_fields.get("core") else ""
    return f"{cpu_fields.get('model', '?')} ({core}{', '.join(has)}), {cpu_fields.get('cpus', '?')} CPUs"
