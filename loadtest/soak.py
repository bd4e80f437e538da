"""Soak: clients that misbehave, on every model, through a real server; every accepted request must end with exactly
one final response (its answer or an error that says why), and the server must let go of everything afterwards.

    python -m loadtest.soak [--patterns P,...] [--models M,...] [--requests 1000] [--light-requests 100]
                            [--clients 1,8] [--rounds 2] [--estimate] [--model DIR] [--out DIR] [--keep]

For each pattern (``loadtest/soak_patterns.py``) and each number of clients it starts a server of its own (the
launcher's way, on free 127.0.0.1 ports; the OpenAI frontend beside it when the pattern needs it); the servers of
one pattern run side by side (one client's cells mostly wait: ``soak_plan.side_by_side``). On each, each model
in turn gets a *cell*: that many client threads send it the cell's requests (``--requests``, or ``--light-requests``
for one client and for llm_static: ``loadtest/soak_plan.py``), none after ``--duration-limit`` seconds. Every request
is accounted for as completed, cancelled, an error that says why, or lost. After each cell the model must settle
within ``--settle-timeout``: nothing pending in Triton (``nv_inference_pending_request_count``), nothing running or
waiting in the engine, no KV block in use; and it must answer a full batch (a request for each of its
``max_num_seqs`` seats, at once), which it cannot if it kept a seat for a request that is gone. The cells run
``--rounds`` times on the same server; then the frontend and tritonserver get SIGTERM: tritonserver must exit 0
within its exit timeout, and the stop says which models it had to end by force (Triton 2.51's gRPC frontend never
releases some requests cancelled right after their final response: docs/server.md, "Stopping the server";
triton_workarounds.CANCEL_AFTER_FINAL_HOLDS_MODEL): each
cell's count of such forced unloads is kept.

Meanwhile it samples, every second, the resident memory of the tritonserver process tree (server + Python-backend
stubs, psutil) and the models' gauges. The same work done again must not need more memory: from two rounds on, each
server's last round's peak RSS is compared with its first's.

Before it starts it prints what it will send and how long that should take, from the rates of a kept soak record
(``--estimate``: that, and nothing else). It writes ``soak.json`` (every cell, the servers, the samples, the verdict),
``soak.png`` (RSS and KV over time) and the run's ``record.json`` under ``--out`` (default
``reports/soak-<time>/``). The record of a full soak (every pattern, model and number of clients, at the default sizes
or more; ``--keep`` keeps a smaller one too, ``--no-keep`` none) is kept as ``records/runs/soak-<cpu>.json``, from
which ``make tables`` writes docs/server.md's soak tables. It prints a table
and exits 1 unless every target holds: no request lost, every cell settled and answered a full batch after it, the
peak RSS grows by less than ``--rss-growth-limit`` (5 %) from the first round to the last, every server stayed up
and exited 0 within its grace on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import requests

from backend.contract.names import (
    KV_BLOCKS_USED,
    MODELS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PENDING_REQUESTS,
)
from backend.triton.launcher.processes import process_names, tree_rss
from backend.triton.launcher.server import ServerError
from loadtest import soak_plan, soak_report
from loadtest.served import Served, add_served_args, read_gauges, settle
from loadtest.signals import exit_on_sigterm
from loadtest.soak_patterns import PATTERNS, Accounts, Budget, Client, Target, full_batch, play
from records.provenance import cpu, cpu_slug
from records.record import Record

REPO_ROOT = Path(__file__).resolve().parents[1]
OPENAI_PATTERNS = ("openai_stream_disconnect",)
# The full soak: what `make soak` runs by default. Its record is the one kept for the docs.
DEFAULTS = {"requests": 1000, "light_requests": 100, "clients": [1, 8], "rounds": 2, "max_tokens": 8,
            "long_tokens": 64}


class Soak:
    def __init__(self, groups: list[soak_plan.Group], args, out: Path,
                 estimated: soak_plan.Estimate | None = None) -> None:
        self.groups, self.args, self.out = groups, args, out
        self.estimated = estimated
        self.cells: list[dict] = []
        self.servers: list[dict] = []
        self.samples: list[dict] = []
        self.running: dict[int, tuple[Served, int]] = {}  # group -> its server and the round it runs, for the samples
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    # -- one cell: a pattern, a number of clients, a model

    def run_cell(self, served: Served, target: Target, round_index: int, pattern: str, num_clients: int, model: str,
                 num_requests: int) -> dict:
        args = self.args
        accounts, budget = Accounts(), Budget(num_requests, args.duration_limit)
        seed = f"{args.seed}:{round_index}:{pattern}:{num_clients}:{model}"
        clients = [Client(i, target, model, random.Random(f"{seed}:{i}"), budget, accounts)
                   for i in range(num_clients)]
        threads = [threading.Thread(target=play, args=(PATTERNS[pattern], c), daemon=True) for c in clients]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        # A client finishes the request (a sequence: the requests) it took before the deadline; each waits at most
        # the request timeout.
        join_by = started + args.duration_limit + (args.sequence_length + 1) * args.request_timeout + 30
        for thread in threads:
            thread.join(max(0.0, join_by - time.monotonic()))
        still_running = [c for c, t in zip(clients, threads) if t.is_alive()]
        for client in still_running:  # NOTE: its thread may still account them later; this cell's count is final
            client.lose_open("the client was still waiting when the cell ended")
        seconds = time.monotonic() - started
        settled = settle(served.metrics_url, [model], args.settle_timeout, lambda: served.is_running)
        answered, batch = full_batch(target, model) if served.is_running else (0, 0)
        if answered < batch:  # what it left pending, if anything, is this cell's
            settled = settle(served.metrics_url, [model], args.settle_timeout, lambda: served.is_running)
        return {
            "round": round_index,
            "pattern": pattern,
            "clients": num_clients,
            "model": model,
            "t_start": round(started - self.t0, 2),
            "seconds": round(seconds, 2),
            "after_s": round(time.monotonic() - started - seconds, 2),
            "requests": accounts.num_requests,
            "out_of_time": budget.num_left > 0,
            "completed": accounts.counts["completed"],
            "cancelled": accounts.counts["cancelled"],
            "errors": accounts.counts["error"],
            "lost": accounts.counts["lost"],
            "error_reasons": dict(accounts.errors),
            "lost_reasons": accounts.lost,
            "client_failures": accounts.failures,
            "clients_still_running": len(still_running),
            "after": settled["gauges"][model],
            "settled_after_s": settled["seconds"],
            "full_batch_after": [answered, batch],
        }

    # -- one server: a pattern and a number of clients, every model, every round

    def run_group(self, index: int, group: soak_plan.Group) -> dict:
        args = self.args
        server = {"pattern": group.pattern, "clients": group.clients, "t_start": round(time.monotonic() - self.t0, 2)}
        served = Served.from_args(args, out=self.out, openai=group.pattern in OPENAI_PATTERNS, name=group.name)
        try:
            server["start_s"] = round(served.start(), 1)
        except (ServerError, RuntimeError) as exc:
            server["start_error"] = str(exc)
            server["stop"] = asdict(served.stop())
            return server
        target = Target(served.grpc_url, served.http_url, served.openai_url, args.request_timeout, args.max_tokens,
                        args.long_tokens, args.sequence_length)
        # NOTE: a full batch on each model before the first round: the memory a model takes on its first forwards
        # belongs to no round (a pattern whose requests barely run the models, bad_requests, grew 6 % without it).
        for model in group.models:
            full_batch(target, model)
        for round_index in range(args.rounds):
            self.running[index] = (served, round_index)
            for model, num_requests in group.requests.items():
                if not served.is_running:
                    break
                cell = self.run_cell(served, target, round_index, group.pattern, group.clients, model, num_requests)
                self.cells.append(cell)
                if served.is_running:  # a round of short cells falls between the sampler's readings
                    self.samples.append(self.sample(index, served, round_index))
                print(f"[soak] {soak_report.cell_line(cell)}; {self.progress()}", flush=True)
        self.running.pop(index, None)
        if not served.is_running:
            server["died"] = served.server.returncode
            server["log_tail"] = served.log_tail()
            server["crash_site"] = served.crash_site()
            print(f"[soak] tritonserver exited ({server['died']}) during {group.name}; the next group gets a new "
                  "server", flush=True)
        server["rss"] = self.rss_report(index, served)
        stopping = time.monotonic()
        server["stop"] = asdict(served.stop())
        server["stop_s"] = round(time.monotonic() - stopping, 1)
        print(f"[soak] server {soak_report.server_line(server)}", flush=True)
        return server

    def run_group_into(self, index: int, found: dict[int, dict]) -> None:
        group = self.groups[index]
        try:
            found[index] = self.run_group(index, group)
        except Exception as exc:  # the soak goes on with the other groups; this one fails every_cell_ran
            print(f"[soak] {group.name} failed: {type(exc).__name__}: {exc}", flush=True)
            found[index] = {"pattern": group.pattern, "clients": group.clients, "start_error": f"soak: {exc}",
                            "stop": {"exit_status": None, "exited_after_s": None, "grace_s": self.args.exit_timeout,
                                     "forced": None, "forced_models": [], "frontend_exit": "not started"}}

    def progress(self) -> str:
        elapsed = time.monotonic() - self.t0
        expected = f" of about {soak_plan.duration(self.estimated.seconds)} expected" if self.estimated else ""
        return f"{soak_plan.duration(elapsed)} so far{expected}"

    # -- sampling

    def sample(self, group: int, served: Served, round_index: int) -> dict:
        rss = tree_rss(served.pid)
        row = {"t": round(time.monotonic() - self.t0, 2), "group": group, "clients": self.groups[group].clients,
               "round": round_index, "load": os.getloadavg()[0], "rss_bytes": sum(rss.values()), "rss_by_pid": rss}
        try:
            row["gauges"] = read_gauges(served.metrics_url, self.args.models)
        except (OSError, requests.RequestException) as exc:
            row["metrics_error"] = str(exc)
        return row

    def sampler(self) -> None:
        while not self.stop.is_set():
            for group, (served, round_index) in list(self.running.items()):
                if served.is_running:
                    self.samples.append(self.sample(group, served, round_index))
            self.stop.wait(self.args.sample_interval)

    def run(self) -> float:
        """Pattern after pattern, its groups (one per number of clients) side by side, each on its own server;
        returns the seconds it took."""
        sampler = threading.Thread(target=self.sampler, daemon=True)
        sampler.start()
        try:
            for batch in soak_plan.side_by_side(self.groups):
                found: dict[int, dict] = {}
                threads = [threading.Thread(target=self.run_group_into, args=(i, found), daemon=True) for i in batch]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                self.servers += [found[i] for i in batch if i in found]
        finally:
            self.stop.set()
            sampler.join(10)
        return time.monotonic() - self.t0

    def rss_report(self, group: int, served: Served) -> dict:
        """The server's peak RSS in each round, and its growth from the first round to the last (from two on)."""
        # NOTE: 0 bytes means the process tree was gone when sampled; such a sample says nothing.
        mine = [s for s in self.samples if s["group"] == group]
        peaks = [max((s["rss_bytes"] for s in mine if s["round"] == r), default=0) for r in range(self.args.rounds)]
        growth = peaks[-1] / peaks[0] - 1 if len(peaks) > 1 and peaks[0] and peaks[-1] else None
        by_process = {}
        for pid, name in process_names(served.pid).items() if served.is_running else ():
            series = [b for s in mine if (b := s["rss_by_pid"].get(pid))]
            if series:
                by_process[f"{name} ({pid})"] = {"first_mb": mib(series[0]), "last_mb": mib(series[-1]),
                                                  "max_mb": mib(max(series))}
        return {"peak_by_round_mb": [mib(b) for b in peaks], "growth": None if growth is None else round(growth, 4),
                "by_process": by_process}


def mib(num_bytes: float) -> float:
    return round(num_bytes / 2**20, 1)


def verdict(report: dict, args, groups: list[soak_plan.Group]) -> dict:
    cells, servers = report["cells"], report["servers"]
    checks = {
        "server_stayed_up": all(s.get("died") is None and not s.get("start_error") for s in servers),
        "every_cell_ran": len(cells) == args.rounds * sum(len(g.models) for g in groups)
        and all(c["requests"] > 0 for c in cells),
        "no_request_lost": all(c["lost"] == 0 and not c["client_failures"] and not c["clients_still_running"]
                               for c in cells),
        "nothing_pending_in_triton_after_each_cell": all(c["after"].get(PENDING_REQUESTS) == 0 for c in cells),
        "engine_idle_after_each_cell": all(c["after"].get(NUM_REQUESTS_RUNNING) == 0
                                           and c["after"].get(NUM_REQUESTS_WAITING) == 0 for c in cells),
        "kv_blocks_back_to_zero_after_each_cell": all(c["after"].get(KV_BLOCKS_USED) == 0 for c in cells),
        "full_batch_answered_after_each_cell": all(c["full_batch_after"][0] == c["full_batch_after"][1] > 0
                                                   for c in cells),
        "sigterm_exit_0_within_grace": all(
            s["stop"]["exit_status"] == 0 and s["stop"]["exited_after_s"] is not None
            and s["stop"]["exited_after_s"] <= s["stop"]["grace_s"] for s in servers),
    }
    if args.rounds > 1:
        checks["peak_rss_growth_between_rounds_below_limit"] = all(
            s.get("rss", {}).get("growth") is not None and s["rss"]["growth"] < args.rss_growth_limit
            for s in servers)
    frontends = [s["stop"]["frontend_exit"] for s in servers if s["stop"]["frontend_exit"] != "not started"]
    if frontends:
        checks["frontend_exit_0"] = all(code == 0 for code in frontends)
    return checks


# ---- the command line -----------------------------------------------------------------------------------------


def names_list(known: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        chosen = list(known) if text == "all" else [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in known]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or text!r}: choose from {', '.join(known)}")
        return chosen

    return parse


def client_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of positive numbers of clients")
    return counts


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--patterns", type=names_list(tuple(PATTERNS)), default=list(PATTERNS),
                        help=f"comma-separated, or all (default): {', '.join(PATTERNS)}")
    parser.add_argument("--models", type=names_list(MODELS), default=list(MODELS),
                        help=f"comma-separated, or all (default): {', '.join(MODELS)}")
    parser.add_argument("--requests", type=int, default=DEFAULTS["requests"],
                        help="requests per cell and round with several clients on llm_dynamic, llm_iterative or "
                        "llm_continuous (default: %(default)s)")
    parser.add_argument("--light-requests", type=int, default=DEFAULTS["light_requests"],
                        help="requests per cell and round with one client, and on llm_static, whose batcher waits up "
                        "to a second for a batch (default: %(default)s)")
    parser.add_argument("--clients", type=client_counts, default=DEFAULTS["clients"],
                        help="numbers of clients at once, each a cell (and a server) of its own (default: 1,8)")
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"],
                        help="times each server runs its cells; from 2 on, RSS growth is checked (default: "
                        "%(default)s)")
    parser.add_argument("--estimate", action="store_true",
                        help="print the plan and its expected duration (from a kept soak record) and exit")
    parser.add_argument("--duration-limit", type=float, default=1800.0,
                        help="seconds after which a cell sends no new request (default: %(default)s)")
    add_served_args(parser)  # --model, --model-repository, --exit-timeout, --server-arg
    parser.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"],
                        help="largest max_tokens of a request run to its end (default: %(default)s)")
    parser.add_argument("--long-tokens", type=int, default=DEFAULTS["long_tokens"],
                        help="max_tokens of a request that is cancelled or dropped (default: %(default)s)")
    parser.add_argument("--sequence-length", type=int, default=20,
                        help="the longest multi-request sequence (perf_analyzer's default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds a request may take to its final response (default: %(default)s)")
    parser.add_argument("--settle-timeout", type=float, default=30.0,
                        help="seconds a model may take to be idle after a cell (default: %(default)s)")
    parser.add_argument("--sample-interval", type=float, default=1.0)
    parser.add_argument("--rss-growth-limit", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="report folder (default: reports/soak-<time>)")
    parser.add_argument("--keep", action=argparse.BooleanOptionalAction, default=None,
                        help="keep the run's record as records/runs/soak-<cpu>.json (default: only a full soak's)")
    return parser.parse_args(argv)


def is_full_soak(args) -> bool:
    """Every pattern, model and number of clients of the default soak, at its sizes or more."""
    return (set(args.patterns) == set(PATTERNS) and set(args.models) == set(MODELS)
            and set(DEFAULTS["clients"]) <= set(args.clients) and args.rounds >= DEFAULTS["rounds"]
            and args.requests >= DEFAULTS["requests"] and args.light_requests >= DEFAULTS["light_requests"])


def announce(groups: list[soak_plan.Group], args, estimated: soak_plan.Estimate | None) -> str:
    cells = sum(len(g.models) for g in groups)
    text = (f"[soak] {len(groups)} servers, {cells} cells, {args.rounds} rounds: "
            f"{soak_plan.total_requests(groups, args.rounds):,} requests ({args.requests} per cell and round with "
            f"several clients, {args.light_requests} with one client or on llm_static); ")
    if estimated is None:
        return text + "no kept soak record (records/runs/soak-*.json) to estimate its duration from"
    text += f"expected duration {soak_plan.duration(estimated.seconds)}, at the rates of {estimated.source}"
    if estimated.unknown:
        text += f" (which has nothing on {len(estimated.unknown)} of its cells, left out)"
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    groups = soak_plan.plan(args.patterns, args.clients, args.models, args.requests, args.light_requests)
    rates = soak_plan.find_rates(cpu_slug(cpu()))
    estimated = soak_plan.estimate(groups, args.rounds, rates) if rates else None
    print(announce(groups, args, estimated), flush=True)
    if args.estimate:
        return 0
    out = Path(args.out) if args.out else REPO_ROOT / "reports" / time.strftime("soak-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    record = Record.start("make soak", {**vars(args), "full_soak": is_full_soak(args)}, measure_bandwidth=False)
    soak = Soak(groups, args, out, estimated)
    load_seconds = soak.run()
    cells = soak.cells
    report = {
        "patterns": args.patterns,
        "models": args.models,
        "clients": args.clients,
        "rounds": args.rounds,
        "requests_per_cell": {"several_clients": args.requests, "light": args.light_requests},
        "expected_duration_s": round(estimated.seconds) if estimated else None,
        "duration_s": round(load_seconds, 1),
        "requests": sum(c["requests"] for c in cells),
        "outcomes": {k: sum(c[k] for c in cells) for k in soak_report.OUTCOMES},
        "rss_growth_limit": args.rss_growth_limit,
        "load_average": soak_report.load_average([s["load"] for s in soak.samples]),
        "servers": soak.servers,
        "cells": cells,
    }
    report["checks"] = verdict(report, args, groups)
    report["ok"] = all(report["checks"].values())
    report["samples"] = soak.samples
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    plotted = soak_report.plot(report, out / "soak.png")
    soak_report.make_record(record, report).write(out / "record.json")
    print(soak_report.summary(report))
    print(f"[soak] report: {out / 'soak.json'}" + (f", {out / 'soak.png'}" if plotted else "")
          + f"; its record: {out / 'record.json'}")
    if args.keep or (args.keep is None and is_full_soak(args)):
        kept = record.write(record.kept_path(soak_plan.RECORD_NAME))
        print(f"[soak] record kept: {kept.relative_to(REPO_ROOT)} (make tables writes docs/server.md's soak tables)")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    exit_on_sigterm()  # the servers it started are stopped, not left running
    sys.exit(main())
