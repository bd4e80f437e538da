"""Two replicas behind vLLM's router (docker/compose.scale.yaml), run: requests spread, a killed replica loses no
request, a stopped one drains without an error, and the killed one rejoins.

The stack is the user's Compose file with :class:`loadtest.scale.ScaleStack`'s override (the host's network, free
127.0.0.1 ports), two replicas of one core each serving ``llm_continuous``, the router in front of their OpenAI
frontends. Locust runs from the virtual environment through the router, as ``make scale`` drives it, and writes every
request's outcome to its records file: each one is answered, or ends with an error that says why; none hangs.
Skipped where no Docker engine answers, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from backend.contract import names
from client import GenerationRequest, LLMClient
from loadtest.runner import LoadPoint, Plan, Target, run_load_point
from loadtest.scale import LOCALHOST, MODEL, STOP_GRACE_S, ScaleStack, run
from tests.server_harness import docker_env_or_skip

pytestmark = [pytest.mark.docker, pytest.mark.slow]

USERS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    env = docker_env_or_skip()
    run("make", "docker", env=env, timeout=1800)
    started = ScaleStack(env, tmp_path_factory.mktemp("scale"))
    try:
        t0 = time.monotonic()
        started.up()
        print(f"\nscale stack up in {time.monotonic() - t0:.1f} s: router {started.router_url}")
        yield started
    finally:
        started.down()


def load(stack: ScaleStack, out, run_s: float, workload: str = "uniform", during=None) -> dict:
    """A bounded Locust run through the router; ``during(t0)`` runs beside it (the fault). Returns Locust's run."""
    target = Target(http_url=stack.balancer_url, grpc_url=f"{LOCALHOST}:{stack.balancer_grpc}",
                    metrics_url=stack.replicas[0].metrics_url, openai_url=stack.router_url)
    plan = Plan(workload=workload, length_scale=0.25, run_s=run_s, ramp_s=0, protocol="openai", max_requests=400,
                stop_timeout_s=60, extra_locust_args=["--request-timeout", "90"])
    fault = threading.Thread(target=during, args=(time.time(),)) if during else None
    if fault:
        fault.start()
    try:
        return run_load_point(target, MODEL, LoadPoint(USERS), plan, out)
    finally:
        if fault:
            fault.join(120)


def outcomes(raw: dict) -> Counter:
    return Counter("ok" if r["ok"] else "cut" if r.get("cut") else "error" for r in raw["requests"])


def test_the_stacks_locust_through_the_router_spreads_requests_over_both_replicas(stack):
    """The Compose file's own Locust master and worker, headless and bounded, streaming through the router: no
    failure, and both replicas serve (each one's own count, from its metrics)."""
    before = stack.replica_counts()
    stats = {s["name"]: s for s in stack.locust(users=USERS, run_s=25)}
    after = stack.replica_counts()
    served = {r: after[r][names.REQUEST_SUCCESS] - before[r][names.REQUEST_SUCCESS] for r in after}
    entry = stats[f"{MODEL} (e2e)"]
    print(f"  Locust: {entry['num_requests']} requests, {entry['num_failures']} failures; per replica {served}")
    assert entry["num_requests"] > 0 and entry["num_failures"] == 0, entry
    assert all(count > 0 for count in served.values()), served
    assert sum(served.values()) >= entry["num_requests"]


def test_the_balancer_spreads_tritons_own_grpc_and_http_over_both_replicas(stack):
    """NGINX in front of the replicas' Triton ports: tritonclient's gRPC streams and HTTP generate_stream, each
    connection to the replica with the fewest open ones."""
    before = stack.replica_counts()
    request = GenerationRequest("The capital of France is", max_tokens=32, ignore_eos=True, temperature=0.0)

    def generate(protocol: str) -> str:
        # A client each: the balancer places connections, and these are open at once (least connections).
        with LLMClient(f"{LOCALHOST}:{stack.balancer_grpc}", stack.balancer_url, protocol=protocol) as client:
            return client.generate(MODEL, request).text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(generate, ["grpc", "http"] * 4))
    after = stack.replica_counts()
    served = {r: after[r][names.REQUEST_SUCCESS] - before[r][names.REQUEST_SUCCESS] for r in after}
    print(f"  balancer: finished per replica {served}")
    assert all(text.strip() for text in texts)  # (not one text: bf16 rounding moves with the batch's make-up)
    assert sum(served.values()) == 8 and all(count > 0 for count in served.values()), served


def test_docker_stop_of_a_replica_drains_it_without_an_error_to_any_client(stack, tmp_path):
    """SIGTERM: the replica answers 503 to new requests and to the router's health check while its open streams
    finish; the router sends what it refused to the other replica. No client sees an error."""
    all_up(stack)
    replica = stack.replicas[0]
    stopped: dict = {}

    def stop(_t0: float) -> None:
        time.sleep(8)
        t = time.monotonic()
        run("docker", "stop", "-t", str(STOP_GRACE_S), container(stack, replica.service), env=stack.env,
            timeout=STOP_GRACE_S + 30)
        stopped.update(seconds=time.monotonic() - t, state=container_state(stack, replica.service))

    raw = load(stack, tmp_path, run_s=30, during=stop)
    seen = outcomes(raw)
    print(f"  docker stop {replica.service}: {stopped.get('seconds', 0):.1f} s, exit status "
          f"{stopped.get('state', {}).get('ExitCode')}; Locust {dict(seen)}")
    assert stopped["state"]["ExitCode"] == 0, stack.logs(replica.service)[-4000:]
    assert seen["error"] == 0, [r["error"] for r in raw["requests"] if r["error"]][:5]
    assert seen["ok"] > 0
    rejoin(stack, replica)


def test_docker_kill_of_a_replica_loses_no_request_and_it_rejoins_after_restart(stack, tmp_path):
    """SIGKILL: streams running on the killed replica end with an error that says so (never a hang); requests sent
    to it before the router noticed are retried on the live one; new requests go to the survivor within seconds;
    restarted, it takes requests again."""
    all_up(stack)
    replica = stack.replicas[1]
    killed: dict = {}

    def kill(t0: float) -> None:
        time.sleep(8)
        killed["at"] = time.time()
        run("docker", "kill", container(stack, replica.service), env=stack.env)
        killed["done"] = time.time()  # a stream the router sent it while the kill was under way may break too
        deadline = time.monotonic() + 30
        while f"{LOCALHOST}:{replica.openai_port}" in "".join(stack.healthy_workers()):
            assert time.monotonic() < deadline, "the router still routes to the killed replica after 30 s"
            time.sleep(0.2)
        killed["left_rotation_s"] = time.time() - killed["at"]

    retries_before = sum(v for k, v in stack.router_counters().items() if "retr" in k)
    raw = load(stack, tmp_path, run_s=35, workload="long_tailed", during=kill)
    retries = sum(v for k, v in stack.router_counters().items() if "retr" in k) - retries_before
    seen = outcomes(raw)
    errors = [r for r in raw["requests"] if not r["ok"] and not r.get("cut")]
    print(f"  docker kill {replica.service}: out of the router's rotation {killed.get('left_rotation_s', 0):.1f} s "
          f"later; router retries {retries:.0f}; Locust {dict(seen)}; errors {Counter(r['error'] for r in errors)}")
    assert killed["left_rotation_s"] < 10
    # Every request ended: answered, or an error with its reason. Locust's --request-timeout would say "timeout".
    assert len(raw["requests"]) == sum(seen.values()) and seen["cut"] == 0
    assert all(r["error"] and "timeout" not in r["error"].lower() for r in errors), errors[:5]
    # Only streams that were running at the kill may fail: they started before it was done and ended after.
    assert all(r["t_start"] < killed["done"] for r in errors), [(r["t_start"] - killed["at"], r["error"])
                                                               for r in errors]
    late = [r for r in raw["requests"] if r["t_start"] > killed["done"] + killed["left_rotation_s"]]
    assert late and all(r["ok"] for r in late)
    rejoin(stack, replica)


def container(stack: ScaleStack, service: str) -> str:
    """The id of the Compose service's one container."""
    ids = run(*stack.compose, "ps", "-a", "-q", service, env=stack.env).stdout.split()
    if len(ids) != 1:
        raise RuntimeError(f"{service}: expected one container, found {ids}")
    return ids[0]


def container_state(stack: ScaleStack, service: str) -> dict:
    """``docker inspect``'s ``State`` of the service's container (``Running``, ``ExitCode``, ...)."""
    return json.loads(run("docker", "inspect", "--format", "{{json .State}}", container(stack, service),
                          env=stack.env).stdout)


def all_up(stack: ScaleStack) -> None:
    """Every replica running and routed to (a test before may have failed with one down)."""
    for replica in stack.replicas:
        if not container_state(stack, replica.service)["Running"]:
            run("docker", "start", container(stack, replica.service), env=stack.env)
    stack.wait_routed(len(stack.replicas), timeout=300)


def rejoin(stack: ScaleStack, replica) -> None:
    """Start ``replica`` again: the router routes to it once it is healthy, and it answers requests."""
    t0 = time.monotonic()
    run("docker", "start", container(stack, replica.service), env=stack.env)
    stack.wait_routed(len(stack.replicas), timeout=300)
    before = stack.replica_counts()[replica.service][names.REQUEST_SUCCESS]

    def complete(_) -> int:
        body = {"model": MODEL, "prompt": f"{uuid.uuid4().hex} is not a word; the capital of France is",
                "max_tokens": 48, "ignore_eos": True, "temperature": 0}
        return requests.post(f"{stack.router_url}/v1/completions", json=body, timeout=120).status_code

    # At once: cache_aware sends work to the least loaded replica once the other holds 4 more (compose.scale.yaml).
    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(complete, range(12)))
    assert statuses == [200] * 12, statuses
    after = stack.replica_counts()[replica.service][names.REQUEST_SUCCESS]
    print(f"  {replica.service} rejoined in {time.monotonic() - t0:.1f} s and answered {after - before:.0f} of 12")
    assert after > before
