"""Replicas behind a router (docker/compose.scale.yaml), run and measured: ``make scale``.

    python -m loadtest.scale [--out reports/scale] [--users 8] [--run-s 60]

One run, on one machine, of the questions docker/README.md's "Several replicas behind a router" answers:

- **2 replicas x 1 core against 1 replica x 2 cores**, behind the same router, on the same load (tokens/s, TTFT and
  TPOT p50/p99). Two cores cannot show scale: what it shows is what splitting the cores costs or saves.
- **Routing policies** on the same two replicas: round robin against the shipped ``cache_aware`` (prefix, then
  load) and ``power_of_two`` (the replicas' ``/get_load``), on the same load and on the ``shared_prefix`` workload,
  with each replica's prefix-cache hit rate (``llm_prefix_cache_hits_total / llm_prefix_cache_queries_total``).

Every stack is the user's Compose file with :class:`ScaleStack`'s override: the services on the host's network and
free 127.0.0.1 ports (the private engine of docker/engine.sh has no bridge), Locust run from this virtual
environment through the router's OpenAI API (loadtest.runner, as ``make compare`` runs it). The replicas' KV
pools are set by ``--kv-cache-bytes``: where a pool cannot hold all sixteen shared prefixes (96 MiB), where a
prefix is sent decides whether it is found; where it can (the default), it does not. Writes ``scale.json`` and its
record ``scale.record.json`` (records/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import requests
import yaml

from backend.contract import names, prometheus
from backend.triton.launcher.launch_options import free_ports
from loadtest.runner import LoadPoint, Plan, Target, run_load_point
from loadtest.stats import summarize
from records.record import Column, Record

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO_ROOT / "docker" / "compose.scale.yaml"
LOCALHOST = "127.0.0.1"
MODEL = names.CONTINUOUS
# docker stop's wait before it kills: compose.scale.yaml's stop_grace_period (the drain delay, the 30-s exit timeout
# and the frontend's stop).
STOP_GRACE_S = 60


def docker_host() -> str | None:
    """The DOCKER_HOST that answers (docker/engine.sh), or None."""
    result = subprocess.run(["bash", str(REPO_ROOT / "docker" / "engine.sh"), "host"], capture_output=True, text=True,
                            timeout=60)
    return (result.stdout.strip() or None) if result.returncode == 0 else None


def run(*args: str, env: dict, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def _local_url(port_attribute: str, path: str = "") -> property:
    """A URL property of a service of the stack: ``http://127.0.0.1:<port>`` and ``path``, the port read from the
    attribute named ``port_attribute`` (every service listens on the host's loopback)."""
    return property(lambda self: f"http://{LOCALHOST}:{getattr(self, port_attribute)}{path}")


@dataclass
class Replica:
    service: str
    cpuset: str
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_port: int

    openai_url = _local_url("openai_port")
    metrics_url = _local_url("metrics_port", "/metrics")


class ScaleStack:
    """docker/compose.scale.yaml as a user runs it, moved onto the host's network and free 127.0.0.1 ports, with
    ``cpusets`` as its replicas (one replica per entry: ``("0", "1")`` is two replicas of one core each)."""

    router_url = _local_url("router_port")
    router_metrics_url = _local_url("router_metrics_port", "/metrics")
    balancer_url = _local_url("balancer_http")

    def __init__(self, env: dict, workdir: Path, cpusets: tuple[str, ...] = ("0", "1"), policy: str = "cache_aware",
                 model_parameters: str = "enable_prefix_caching=true", models: str = MODEL) -> None:
        if not 1 <= len(cpusets) <= 2:
            raise ValueError("docker/compose.scale.yaml has two replicas: run one or both")
        self.env = {**env, "ROUTER_POLICY": policy, "SCALE_MODEL_PARAMETERS": model_parameters,
                    "SCALE_MODELS": models}
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.policy = policy
        ports = iter(free_ports(4 * len(cpusets) + 4))
        self.replicas = [Replica(f"triton-{i + 1}", cpuset, *(next(ports) for _ in range(4)))
                         for i, cpuset in enumerate(cpusets)]
        self.router_port, self.router_metrics_port, self.balancer_http, self.balancer_grpc = (next(ports)
                                                                                             for _ in range(4))
        self.project = f"llmscale{uuid.uuid4().hex[:6]}"
        override = self.workdir / f"{self.project}.override.yaml"
        override.write_text(self._override())
        self.compose = ["docker", "compose", "-p", self.project, "-f", str(COMPOSE_FILE), "-f", str(override)]

    def _override(self) -> str:
        """The test's and the measurement's override: only addresses, ports and (for one replica) which replicas."""
        host = {"network_mode": "host", "ports": "RESET"}
        services: dict = {}
        for r in self.replicas:
            services[r.service] = {
                **host, "cpuset": r.cpuset,
                "environment": {"HTTP_PORT": str(r.http_port), "GRPC_PORT": str(r.grpc_port),
                                "METRICS_PORT": str(r.metrics_port), "OPENAI_PORT": str(r.openai_port)},
                # NOTE: only the listening address is added: on the host's network the image's 0.0.0.0 would be
                # every interface of this machine.
                "command": ["python3", "-m", "backend.triton.launcher.serve",
                            "--model-repository=/opt/llm/model_repository", "--address", LOCALHOST, "--",
                            "--exit-timeout-secs=30"],
            }
        router_command = [
            "--host", LOCALHOST, "--port", str(self.router_port), "--prometheus-host", LOCALHOST,
            "--prometheus-port", str(self.router_metrics_port), "--worker-urls",
            *(r.openai_url for r in self.replicas), "--policy", self.policy,
            *yaml.safe_load(COMPOSE_FILE.read_text())["services"]["router"]["command"].split("--policy")[1]
            .split(None, 1)[1].split(),
        ]  # the user's options after --policy, unchanged
        services["router"] = {**host, "command": router_command, "depends_on": "REPLICAS"}
        services["balancer"] = {**host, "depends_on": "REPLICAS", "environment": {
            "LISTEN": LOCALHOST, "HTTP_PORT": str(self.balancer_http), "GRPC_PORT": str(self.balancer_grpc),
            "TRITON_HTTP": " ".join(f"{LOCALHOST}:{r.http_port}" for r in self.replicas),
            "TRITON_GRPC": " ".join(f"{LOCALHOST}:{r.grpc_port}" for r in self.replicas)}}
        text = yaml.safe_dump({"services": services}, sort_keys=False)
        healthy = "".join(f"\n      {r.service}:\n        condition: service_healthy" for r in self.replicas)
        return text.replace("ports: RESET", "ports: !reset []").replace("depends_on: REPLICAS",
                                                                        f"depends_on: !override{healthy}")

    # ---- the stack's life ---------------------------------------------------------------------------------------

    def up(self, timeout: float = 600) -> "ScaleStack":
        """The replicas, the router and the balancer, once every replica is healthy and the router routes to all."""
        services = [r.service for r in self.replicas] + ["router", "balancer"]
        run(*self.compose, "up", "-d", "--no-build", "--wait", "--wait-timeout", str(int(timeout)), *services,
            env=self.env, timeout=timeout + 60)
        self.wait_routed(len(self.replicas), timeout=120)
        return self

    def down(self) -> None:
        run(*self.compose, "down", "-t", "5", "-v", env=self.env, timeout=180, check=False)

    def logs(self, service: str) -> str:
        result = run(*self.compose, "logs", "--no-color", service, env=self.env, check=False)
        return result.stdout + result.stderr

    def healthy_workers(self) -> set[str]:
        """The worker URLs the router routes to now (its own view, from its health checks)."""
        workers = requests.get(f"{self.router_url}/workers", timeout=5).json()["workers"]
        return {w["url"].rstrip("/") for w in workers if w.get("is_healthy")}

    def wait_routed(self, count: int, timeout: float) -> float:
        """Seconds until the router routes to ``count`` healthy workers."""
        t0 = time.monotonic()
        while True:
            try:
                if len(self.healthy_workers()) == count:
                    return time.monotonic() - t0
            except (requests.RequestException, ValueError):
                pass
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"the router does not route to {count} workers in {timeout} s:\n"
                                   f"{self.logs('router')[-3000:]}")
            time.sleep(0.5)

    def locust(self, users: int, run_s: int, length_scale: float = 0.25) -> list[dict]:
        """The stack's own Locust (its master and one worker, as the user's Compose file runs them) headless through
        the router for ``run_s`` seconds; Locust's stats (its ``--json``), one entry per request name."""
        (master_port,) = free_ports(1)
        host = {"network_mode": "host", "ports": "RESET"}
        master = shlex.split(yaml.safe_load(COMPOSE_FILE.read_text())["services"]["locust-master"]["command"])
        classes = [a for a in master if a.endswith("User")]
        services = {
            "locust-master": {**host, "depends_on": "NONE", "command": [
                "-f", "loadtest/locustfile.py", "--master", "--master-bind-host", LOCALHOST, "--master-bind-port",
                str(master_port), "--headless", "--expect-workers", "1", "-u", str(users), "-r", str(users),
                "--run-time", f"{run_s}s", "--stop-timeout", "60", "--host", self.balancer_url,
                "--openai-url", self.router_url, "--model", MODEL, "--length-scale", f"{length_scale:g}", "--json",
                *classes]},
            "locust-worker": {"network_mode": "host", "command": [
                *yaml.safe_load(COMPOSE_FILE.read_text())["services"]["locust-worker"]["command"][:3],
                "--master-host", LOCALHOST, "--master-port", str(master_port), *classes]},
        }
        text = yaml.safe_dump({"services": services}, sort_keys=False)
        override = self.workdir / f"{self.project}.locust.yaml"
        override.write_text(text.replace("ports: RESET", "ports: !reset []").replace("depends_on: NONE",
                                                                                      "depends_on: !reset []"))
        compose = [*self.compose, "-f", str(override)]
        env = {**self.env, "LOCUST_WORKERS": "1"}
        run(*compose, "up", "-d", "--no-build", "--no-deps", "locust-master", "locust-worker", env=env, timeout=300)
        master_id = run(*compose, "ps", "-a", "-q", "locust-master", env=env).stdout.split()[0]
        code = int(run("docker", "wait", master_id, env=env, timeout=run_s + 180).stdout.strip())
        out = run("docker", "logs", master_id, env=env)
        run(*compose, "rm", "-f", "-s", "locust-master", "locust-worker", env=env, timeout=120, check=False)
        if code != 0:
            raise RuntimeError(f"Locust's master exited {code}:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout[out.stdout.index("["):])

    # ---- what the replicas and the router counted ----------------------------------------------------------------

    def replica_counts(self) -> dict[str, dict[str, float]]:
        """Per replica: requests finished, prompt tokens looked up and served from the prefix cache (the model's)."""
        counts = {}
        for r in self.replicas:
            series = prometheus.read(r.metrics_url) or []
            total = {name: sum(prometheus.by_model(series, name).values())
                     for name in (names.REQUEST_SUCCESS, names.PREFIX_CACHE_QUERIES, names.PREFIX_CACHE_HITS)}
            counts[r.service] = total
        return counts

    def router_counters(self) -> dict[str, float]:
        """The router's own counters (``vllm_router_*``: requests, retries, ...), summed over their labels."""
        totals: dict[str, float] = {}
        for s in prometheus.read(self.router_metrics_url) or []:
            if s.name.endswith("_total"):
                totals[s.name] = totals.get(s.name, 0.0) + s.value
        return totals


def counts_between(before: dict, after: dict) -> dict[str, dict[str, float]]:
    return {replica: {k: after[replica][k] - before[replica].get(k, 0.0) for k in after[replica]} for replica in after}


def hit_rate(delta: dict[str, dict[str, float]]) -> float | None:
    queries = sum(d[names.PREFIX_CACHE_QUERIES] for d in delta.values())
    return sum(d[names.PREFIX_CACHE_HITS] for d in delta.values()) / queries if queries else None


# ---- the measurement ------------------------------------------------------------------------------------------------

# (label, cpusets, policy): the stacks compared, each started fresh (empty prefix caches).
STACKS = (
    ("2 x 1 core, cache_aware", ("0", "1"), "cache_aware"),
    ("1 x 2 cores, cache_aware", ("0,1",), "cache_aware"),
    ("2 x 1 core, round_robin", ("0", "1"), "round_robin"),
    ("2 x 1 core, power_of_two", ("0", "1"), "power_of_two"),
)


def measure_stack(label: str, cpusets: tuple[str, ...], policy: str, args: argparse.Namespace, env: dict,
                  out: Path, say=print) -> list[dict]:
    stack = ScaleStack(env, out / "stacks", cpusets, policy,
                       model_parameters=f"enable_prefix_caching=true kv_cache_memory_bytes={args.kv_cache_bytes}")
    rows = []
    try:
        t0 = time.monotonic()
        stack.up()
        say(f"[scale] {label}: up in {time.monotonic() - t0:.0f} s")
        target = Target(http_url=stack.balancer_url, grpc_url=f"{LOCALHOST}:{stack.balancer_grpc}",
                        metrics_url=stack.replicas[0].metrics_url, openai_url=stack.router_url)
        for workload in args.workloads:
            plan = Plan(workload=workload, length_scale=args.length_scale, run_s=args.run_s, ramp_s=args.ramp_s,
                        protocol="openai", max_requests=args.max_requests)
            before, router_before = stack.replica_counts(), stack.router_counters()
            raw = run_load_point(target, MODEL, LoadPoint(args.users), plan, out / "runs" / policy / "-".join(cpusets))
            delta = counts_between(before, stack.replica_counts())
            router_delta = {k: v - router_before.get(k, 0.0) for k, v in stack.router_counters().items()}
            row = summarize(raw, plan.slo_ttft_ms, plan.slo_tpot_ms)
            rows.append({
                "stack": label, "replicas": len(cpusets), "policy": policy, "workload": workload,
                "users": args.users,
                **{k: row[k] for k in ("num_requests", "num_failed_total", "output_tok_per_s", "req_per_s",
                                       "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")},
                "per_replica": {r: int(d[names.REQUEST_SUCCESS]) for r, d in delta.items()},
                "prefix_hit_rate": hit_rate(delta),
                "router_retries": sum(v for k, v in router_delta.items() if "retr" in k),
            })
            say(f"[scale]   {workload}: {row['output_tok_per_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                f"per replica {rows[-1]['per_replica']}, prefix hits {rows[-1]['prefix_hit_rate']}")
    finally:
        stack.down()
    return rows


COLUMNS = [
    Column("stack"), Column("workload"), Column("output_tok_per_s", "output tok/s", "{:.1f}"),
    Column("ttft_p50_ms", "TTFT p50", "ms"), Column("ttft_p99_ms", "TTFT p99", "ms"),
    Column("tpot_p50_ms", "TPOT p50", "ms"), Column("tpot_p99_ms", "TPOT p99", "ms"),
    Column("per_replica", "requests per replica"), Column("prefix_hit_rate", "prefix-cache hit rate", "{:.0%}"),
    Column("router_retries", "router retries", "{:.0f}"), Column("num_failed_total", "failed"),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "reports" / "scale")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--run-s", type=float, default=60.0)
    p.add_argument("--ramp-s", type=float, default=5.0)
    p.add_argument("--max-requests", type=int, default=2000)
    p.add_argument("--length-scale", type=float, default=0.5)
    p.add_argument("--workloads", nargs="+", default=["long_tailed", "shared_prefix"])
    p.add_argument("--kv-cache-bytes", type=int, default=192 * 2**20,
                   help="each replica's KV pool (default: %(default)s, 192 MiB: about 550 blocks, enough for all of "
                   "the shared_prefix workload's 16 prefixes; 96 MiB holds about half of them)")
    p.add_argument("--stacks", nargs="+", choices=[s[0] for s in STACKS], default=[s[0] for s in STACKS],
                   metavar="STACK", help="default: all of " + "; ".join(s[0] for s in STACKS))
    args = p.parse_args(argv)
    host = docker_host()
    if host is None:
        p.error("no Docker engine answers: run `make docker` first (it provisions one and builds the images)")
    env = {**os.environ, "DOCKER_HOST": host}
    args.out.mkdir(parents=True, exist_ok=True)
    record = Record.start("python -m loadtest.scale", {k: str(v) if isinstance(v, Path) else v
                                                      for k, v in vars(args).items()})
    rows = []
    for label, cpusets, policy in STACKS:
        if label in args.stacks:
            rows += measure_stack(label, cpusets, policy, args, env, args.out)
    table = record.add_table("stacks", COLUMNS, [{**{c.key: r.get(c.key) for c in COLUMNS},
                                                  "per_replica": " / ".join(map(str, r["per_replica"].values()))}
                                                 for r in rows])
    record.write_beside(args.out / "scale.json", {"rows": rows})
    print(table.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
