"""Soak: mixed load with cancellations and bad requests against llm_dynamic and llm_continuous, watching memory and
the KV cache.

    python -m loadtest.soak [--duration 600] [--users 8] [--model DIR] [--model-repository DIR] [--out DIR]

Starts its own tritonserver (the launcher's way, on free 127.0.0.1 ports), then runs ``--users`` closed-loop users
for ``--duration`` seconds. Each request is one of: a gRPC stream to completion, a gRPC stream cancelled after a
few tokens (``stop_stream(cancel_requests=True)``), an HTTP /generate, an HTTP /generate_stream dropped after a few
events, or a bad request (empty prompt, max_tokens 0, top_p 2, an unknown key, broken JSON, a prompt over the byte
limit). Every request is accounted for as completed, cancelled or refused; anything else (no final response within
the timeout, an unexpected error, a wrong number of tokens) is *lost*.

Meanwhile it samples, every second, the resident memory of the tritonserver process tree (server + Python-backend
stubs, psutil) and the KV blocks in use (the ``llm_kv_blocks_used`` gauges). When the load stops, the KV cache and
the running/waiting gauges must return to zero.

Writes ``soak.json`` (samples, counts by outcome and error kind, verdict) and ``soak.png`` (RSS and KV over time)
under ``--out`` (default ``reports/soak-<time>/``), prints a summary, and exits 1 unless the targets hold:
RSS after warm-up grows by less than ``--rss-growth-limit`` (5 %), the KV cache is back to zero, no request lost.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

from backend.triton.names import CONTINUOUS, DYNAMIC, KV_BLOCKS_USED, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from backend.triton.processes import process_names, tree_rss
from backend.triton.server import start_on_free_ports
from client.grpc_stream import GrpcStream, generate, start_stream
from loadtest.metrics import model_sample, scrape_metrics

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS = (DYNAMIC, CONTINUOUS)
# The gauges sampled per model: back to 0 once the load stops, or something leaked.
GAUGES = (KV_BLOCKS_USED, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING)
PROMPTS = [
    "Tell me a story about a lighthouse keeper.",
    "List five prime numbers and explain why they are prime.",
    "Write a haiku about the sea.",
    "What is continuous batching?",
    "Count from one to twenty.",
    "Explain the difference between a list and a tuple in Python.",
]


# ---- the soak ----------------------------------------------------------------------------------------------------

# Bad requests and a piece of the error each must produce: (name, HTTP body, expected text).
BAD_REQUESTS = [
    ("empty_prompt", {"text_input": ""}, "text_input is empty"),
    ("max_tokens_0", {"text_input": "Hi", "max_tokens": 0}, "max_tokens must be a positive integer"),
    ("top_p_2", {"text_input": "Hi", "top_p": 2.0}, "top_p must be in (0, 1]"),
    ("unknown_key", {"text_input": "Hi", "sampling_parameters": '{"best_of": 2}'}, "unknown key"),
    ("broken_json", {"text_input": "Hi", "sampling_parameters": "{max_tokens:"}, "not valid JSON"),
    ("prompt_too_large", {"text_input": "x" * 100_000}, "the limit is"),
]
OVERLOADED = ("overloaded", "maximum queue size")


class Accounts:
    """Every request's outcome, counted by kind; the lost ones keep a reason."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.by_kind: collections.Counter = collections.Counter()
        self.lost: list[str] = []

    def add(self, outcome: str, kind: str, reason: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            self.by_kind[f"{outcome}:{kind}"] += 1
            if outcome == "lost":
                self.lost.append(f"{kind}: {reason}"[:300])


class Soak:
    def __init__(
        self, http_url: str, grpc_url: str, metrics_url: str, server_pid: int, args, server_exit=lambda: None
    ) -> None:
        self.http_url, self.grpc_url, self.metrics_url = http_url, grpc_url, metrics_url
        self.server_pid = server_pid
        self.server_exit = server_exit  # () -> None while the server runs, else its exit status
        self.args = args
        self.accounts = Accounts()
        self.samples: list[dict] = []
        self.stop = threading.Event()

    # -- one request of each kind

    def one_request(self, rng: random.Random) -> None:
        model = rng.choice(MODELS)
        kind = rng.choices(["stream", "cancel", "http", "http_drop", "bad"], weights=[45, 20, 15, 10, 10])[0]
        prompt = rng.choice(PROMPTS)
        max_tokens = rng.randint(4, self.args.max_tokens)
        try:
            getattr(self, f"_{kind}")(rng, model, prompt, max_tokens)
        except Exception as exc:  # a client-side failure is a lost request too: it was not answered as it should
            self.accounts.add("lost", f"{kind}:{model}", f"{type(exc).__name__}: {exc}")

    def _stream(self, rng, model, prompt, max_tokens) -> None:
        stream = generate(
            self.grpc_url,
            model,
            prompt,
            timeout=self.args.request_timeout,
            max_tokens=max_tokens,
            ignore_eos=True,
            stream=True,
            temperature=rng.choice([0.0, 0.8]),
            seed=rng.randint(0, 9),
        )
        self._account_stream(f"stream:{model}", stream, max_tokens)

    def _account_stream(self, kind: str, stream: GrpcStream, max_tokens: int) -> None:
        if not stream.final:
            self.accounts.add("lost", kind, f"no final response within {self.args.request_timeout} s")
        elif stream.error is not None:
            self._account_error(kind, stream.error)
        elif len(stream.token_ids) != max_tokens or stream.finish_reason != "length":
            self.accounts.add("lost", kind, f"{len(stream.token_ids)} of {max_tokens} tokens, {stream.finish_reason!r}")
        else:
            self.accounts.add("completed", kind)

    def _account_error(self, kind: str, error: str) -> None:
        if any(word in error for word in OVERLOADED):
            self.accounts.add("refused", f"overloaded:{kind}")
        else:
            self.accounts.add("lost", kind, f"unexpected error: {error}")

    def _cancel(self, rng, model, prompt, max_tokens) -> None:
        stream = start_stream(self.grpc_url, model, prompt, max_tokens=200, ignore_eos=True, stream=True)
        try:
            stream.wait_tokens(rng.randint(0, 8), timeout=self.args.request_timeout)
            if stream.final and stream.error is not None:
                self._account_error(f"cancel:{model}", stream.error)
                return
            stream.cancel()
        finally:
            stream.close()
        self.accounts.add("cancelled", f"grpc:{model}")

    def _http(self, rng, model, prompt, max_tokens) -> None:
        body = {"text_input": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
        response = requests.post(
            f"{self.http_url}/v2/models/{model}/generate", json=body, timeout=self.args.request_timeout
        )
        kind = f"http:{model}"
        if response.status_code != 200:
            self._account_error(kind, response.text)
        elif response.json().get("num_output_tokens") != max_tokens:
            self.accounts.add("lost", kind, f"wrong answer: {response.text[:200]}")
        else:
            self.accounts.add("completed", kind)

    def _http_drop(self, rng, model, prompt, max_tokens) -> None:
        body = {"text_input": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with requests.post(
            f"{self.http_url}/v2/models/{model}/generate_stream",
            json=body,
            stream=True,
            timeout=self.args.request_timeout,
        ) as response:
            if response.status_code != 200:
                self._account_error(f"http_drop:{model}", response.text)
                return
            wanted, seen = rng.randint(1, 8), 0
            for line in response.iter_lines():
                seen += line.startswith(b"data:")
                if seen >= wanted:
                    break
        self.accounts.add("cancelled", f"http_drop:{model}")  # closing the connection cancels the request

    def _bad(self, rng, model, prompt, max_tokens) -> None:
        name, body, expected = rng.choice(BAD_REQUESTS)
        response = requests.post(
            f"{self.http_url}/v2/models/{model}/generate", json=body, timeout=self.args.request_timeout
        )
        if response.status_code == 400 and expected in response.text:
            self.accounts.add("refused", f"bad:{name}")
        else:
            self.accounts.add("lost", f"bad:{name}:{model}", f"HTTP {response.status_code}: {response.text[:200]}")

    # -- users and sampling

    def user(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        while not self.stop.is_set():
            self.one_request(rng)

    def sample(self, t0: float) -> dict:
        rss = tree_rss(self.server_pid)
        row = {"t": round(time.monotonic() - t0, 2), "rss_bytes": sum(rss.values()), "rss_by_pid": rss}
        try:
            metrics = scrape_metrics(self.metrics_url)
            for name in GAUGES:
                row[name] = {m: model_sample(metrics, name, m) for m in MODELS}
        except requests.RequestException as exc:
            row["metrics_error"] = str(exc)
        return row

    def sampler(self, t0: float) -> None:
        while not self.stop.is_set():
            if self.server_exit() is not None:  # the server died: nothing more to measure, end the load now
                print(f"[soak] tritonserver exited ({self.server_exit()}) during the load", flush=True)
                self.stop.set()
                return
            self.samples.append(self.sample(t0))
            self.stop.wait(self.args.sample_interval)

    def run(self) -> dict:
        t0 = time.monotonic()
        sampler = threading.Thread(target=self.sampler, args=(t0,), daemon=True)
        users = [threading.Thread(target=self.user, args=(i,), daemon=True) for i in range(self.args.users)]
        sampler.start()
        for user in users:
            user.start()
        self.stop.wait(self.args.duration)
        self.stop.set()
        for user in users:
            user.join(self.args.request_timeout + 30)
        sampler.join(10)
        load_seconds = time.monotonic() - t0
        drained = self.wait_idle(t0)
        return self.report(load_seconds, drained, still_running=sum(u.is_alive() for u in users))

    def wait_idle(self, t0: float, timeout: float = 30.0) -> dict:
        """After the load: the gauges must come back to zero (KV blocks, running, waiting)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.server_exit() is not None:
                return {}
            row = self.sample(t0)
            self.samples.append(row)
            values = [
                v
                for name in GAUGES
                for v in row.get(name, {}).values()
            ]
            if values and all(v == 0 for v in values):
                return row
            if time.monotonic() > deadline:
                return row
            time.sleep(0.5)

    def report(self, load_seconds: float, idle_row: dict, still_running: int) -> dict:
        # NOTE: 0 bytes means the process tree was gone when sampled; such a sample says nothing about growth.
        rss = [(s["t"], s["rss_bytes"]) for s in self.samples if s["t"] <= load_seconds and s["rss_bytes"]]
        warmup = self.args.warmup if self.args.warmup is not None else max(10.0, 0.2 * self.args.duration)
        window = max(5.0, 0.15 * self.args.duration)
        after_warmup = [b for t, b in rss if warmup <= t < warmup + window]
        at_end = [b for t, b in rss if t >= load_seconds - window]
        growth = (statistics.median(at_end) / statistics.median(after_warmup) - 1) if after_warmup and at_end else None
        kv_after = {m: idle_row.get(KV_BLOCKS_USED, {}).get(m) for m in MODELS}
        gauges_after = {name: idle_row.get(name, {}) for name in GAUGES}
        counts = dict(self.accounts.counts)
        total = sum(counts.values())
        server_exit = self.server_exit()
        checks = {
            "server_stayed_up": server_exit is None,
            "rss_growth_after_warmup_below_limit": growth is not None and growth < self.args.rss_growth_limit,
            "kv_and_gauges_back_to_zero": bool(gauges_after)
            and all(v == 0 for g in gauges_after.values() for v in g.values()),
            "no_request_lost": counts.get("lost", 0) == 0 and still_running == 0,
            "requests_served": counts.get("completed", 0) > 0,
        }
        names = process_names(self.server_pid)
        rss_by_process = {}
        for pid, name in names.items():
            series = [s["rss_by_pid"].get(pid) for s in self.samples if s["t"] <= load_seconds]
            series = [b for b in series if b]
            if series:
                rss_by_process[f"{name} ({pid})"] = {
                    "first_mb": round(series[0] / 2**20, 1),
                    "last_mb": round(series[-1] / 2**20, 1),
                }
        return {
            "duration_s": round(load_seconds, 1),
            "server_exit": server_exit,
            "users": self.args.users,
            "requests": total,
            "requests_per_s": round(total / load_seconds, 2) if load_seconds else 0.0,
            "outcomes": counts,
            "by_kind": dict(sorted(self.accounts.by_kind.items())),
            "lost": self.accounts.lost[:50],
            "rss": {
                "warmup_s": warmup,
                "window_s": window,
                "after_warmup_mb": round(statistics.median(after_warmup) / 2**20, 1) if after_warmup else None,
                "at_end_mb": round(statistics.median(at_end) / 2**20, 1) if at_end else None,
                "max_mb": round(max(b for _, b in rss) / 2**20, 1) if rss else None,
                "growth": None if growth is None else round(growth, 4),
                "limit": self.args.rss_growth_limit,
                "by_process": rss_by_process,
            },
            "after_load": gauges_after,
            "kv_blocks_used_after_load": kv_after,
            "checks": checks,
            "ok": all(checks.values()),
            "samples": self.samples,
        }


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    samples = report["samples"]
    t = [s["t"] for s in samples]
    fig, (ax_rss, ax_kv) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax_rss.plot(t, [s["rss_bytes"] / 2**20 for s in samples])
    ax_rss.axvline(report["rss"]["warmup_s"], color="grey", linestyle=":", label="end of warm-up")
    ax_rss.set_ylabel("tritonserver tree RSS (MiB)")
    ax_rss.legend(loc="lower right")
    for model in MODELS:
        ax_kv.plot(t, [s.get("llm_kv_blocks_used", {}).get(model, float("nan")) for s in samples], label=model)
    ax_kv.axvline(report["duration_s"], color="grey", linestyle=":", label="load stops")
    ax_kv.set_ylabel("KV blocks in use")
    ax_kv.set_xlabel("seconds")
    ax_kv.legend(loc="upper right")
    fig.suptitle(f"soak: {report['requests']} requests, {report['outcomes']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def summary(report: dict) -> str:
    rss = report["rss"]
    growth = "n/a" if rss["growth"] is None else f"{100 * rss['growth']:+.2f} %"
    lines = [
        f"soak: {report['duration_s']} s, {report['users']} users, {report['requests']} requests "
        f"({report['requests_per_s']}/s)",
        "  outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items())),
        f"  RSS after warm-up {rss['after_warmup_mb']} MiB, at the end {rss['at_end_mb']} MiB ({growth}; "
        f"limit {100 * rss['limit']:.0f} %), max {rss['max_mb']} MiB",
        f"  KV blocks in use after the load: {report['kv_blocks_used_after_load']}",
        "  RSS by process (first -> last sample): "
        + ", ".join(f"{name} {v['first_mb']} -> {v['last_mb']} MiB" for name, v in rss["by_process"].items()),
    ]
    lines += [f"  {'ok  ' if ok else 'FAIL'} {name}" for name, ok in report["checks"].items()]
    if report.get("server_exit") is not None:
        lines.append(f"  tritonserver exited with status {report['server_exit']} during the soak; its last lines:")
        lines += [f"    {line}" for line in report.get("server_log_tail", [])]
        if report.get("server_crash_site"):
            lines.append(f"  it crashed in {report['server_crash_site']}")
    lines += [f"  lost: {reason}" for reason in report["lost"][:10]]
    return "\n".join(lines)


def crash_lines(log: Path, count: int = 12) -> list[str]:
    """The server log's last lines, from its last "Signal (N) received." on if it has one (the crash and its stack)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    lines = [line for line in lines if "NVML" not in line]  # the container-less machine's one noisy line
    signal = max((i for i, line in enumerate(lines) if line.startswith("Signal (")), default=None)
    return lines[signal : signal + count] if signal is not None else lines[-count:]


FRAME = re.compile(r"^\s*(\d+)# 0x([0-9A-Fa-f]+) in (\S+/bin/tritonserver)$")


def crash_site(lines: list[str]) -> str | None:
    """The tritonserver function that crashed, from the raw addresses of a "Signal (N) received." stack.

    Triton prints addresses only, but the bundled binary keeps its symbols: frame 0 lies in its
    ErrorSignalHandler, which gives the load address; the next tritonserver frame after libc's signal trampoline
    is where the fault happened. None when the stack or the tools (nm, addr2line) are not there.
    """
    frames = [(int(m[1]), int(m[2], 16), m[3]) for m in map(FRAME.match, lines) if m]
    if len(frames) < 2 or frames[0][0] != 0:
        return None
    binary = frames[0][2]
    try:
        symbols = subprocess.run(["nm", "-C", binary], capture_output=True, text=True, timeout=60).stdout
        handler = next(
            int(line.split()[0], 16) for line in symbols.splitlines() if line.endswith("::ErrorSignalHandler(int)")
        )
        base = (frames[0][1] - handler) & ~0xFFF
        where = subprocess.run(
            ["addr2line", "-f", "-C", "-e", binary, hex(frames[1][1] - base)],
            capture_output=True, text=True, timeout=60,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError, StopIteration, ValueError):
        return None
    return where[0] if where and where[0] != "??" else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default: %(default)s)")
    parser.add_argument("--users", type=int, default=8, help="concurrent closed-loop users (default: %(default)s)")
    parser.add_argument("--model", default=None, help="HF model folder (default: the repository's own setting)")
    parser.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    parser.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens of a request")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--sample-interval", type=float, default=1.0)
    parser.add_argument("--warmup", type=float, default=None, help="seconds (default: 20 %% of the duration, >= 10)")
    parser.add_argument("--rss-growth-limit", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="report folder (default: reports/soak-<time>)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra tritonserver argument (repeatable)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else REPO_ROOT / "reports" / time.strftime("soak-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    with start_on_free_ports(
        args.model_repository,
        model=args.model,
        log_path=out / "tritonserver.log",
        extra_args=["--exit-timeout-secs", "10", *args.server_arg],
        ready_timeout=600,
    ) as server:
        print(f"[soak] server ready (pid {server.pid}); {args.users} users for {args.duration:.0f} s", flush=True)
        soak = Soak(server.http_url, server.grpc_url, server.metrics_url, server.pid, args, lambda: server.returncode)
        report = soak.run()
    if report["server_exit"] is not None:
        report["server_log_tail"] = crash_lines(out / "tritonserver.log")
        report["server_crash_site"] = crash_site(report["server_log_tail"])
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    plotted = plot(report, out / "soak.png")
    print(summary(report))
    print(f"[soak] report: {out / 'soak.json'}" + (f", {out / 'soak.png'}" if plotted else ""))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
