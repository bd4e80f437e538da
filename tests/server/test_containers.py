"""The containers, built and run: the CPU image of what `make serve` runs, `docker stop` under load, the Compose stack.

Each test runs real containers on a real Docker engine: the one that answers (``DOCKER_HOST`` or the default socket,
or the private engine of ``docker/engine.sh``, which ``.ci/run`` starts when the machine has none). The images are
built first by ``make docker``, as a user builds them (a warm build takes seconds). Containers use the host's network
and listen on 127.0.0.1 only, on free ports. Where no engine answers they are skipped, except under ``CI=true``,
where they fail.

The Compose test runs the files a user runs (``docker/compose.yaml`` and ``docker/compose.cpu.yaml``) with a test
override that only moves the services onto the host's network and free ports, runs Locust headless for a bounded run
over every model, and stands in for the Prometheus image when it cannot be pulled (tests/docker/prometheus.Dockerfile).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import requests
import yaml

from backend.triton.launcher.launch_options import free_ports
from loadtest.scale import run
from tests.server.test_shutdown import SHUTTING_DOWN, MetricsTrail, requests_of, start_locust, unload_times
from tests.server_harness import LOCALHOST, REPO_ROOT, docker_env_or_skip

pytestmark = [pytest.mark.docker, pytest.mark.slow]

MODELS = ("llm_static", "llm_dynamic", "llm_iterative", "llm_continuous")
TRITON_IMAGE = os.environ.get("TRITON_IMAGE", "llm-batching-triton:cpu")
LOCUST_IMAGE = os.environ.get("LOCUST_IMAGE", "llm-batching-locust:latest")
COMPOSE_FILES = (REPO_ROOT / "docker" / "compose.yaml", REPO_ROOT / "docker" / "compose.cpu.yaml")
PROMETHEUS_STAND_IN = "llm-batching-test/prometheus:bookworm"
# docker stop's grace, compose's stop_grace_period: more than the image's 30-s exit timeout.
STOP_GRACE_S = 40
PROMPTS = ("The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):")


@pytest.fixture(scope="module")
def docker_env() -> dict:
    """The environment for docker commands, once ``make docker`` has built the CPU images."""
    env = docker_env_or_skip()
    t0 = time.monotonic()
    run("make", "docker", f"TRITON_IMAGE={TRITON_IMAGE}", f"LOCUST_IMAGE={LOCUST_IMAGE}", env=env, timeout=1800)
    print(f"\nmake docker: {time.monotonic() - t0:.1f} s")
    return env


def healthy(container: str, env: dict, timeout: float) -> None:
    """Wait for the image's HEALTHCHECK to pass (its probe: /v2/health/ready and every engine healthy)."""
    deadline = time.monotonic() + timeout
    while True:
        state = json.loads(run("docker", "inspect", "--format", "{{json .State}}", container, env=env).stdout)
        if state["Health"]["Status"] == "healthy":
            return
        logs = run("docker", "logs", "--tail", "40", container, env=env, check=False)
        assert state["Running"], f"{container} exited {state['ExitCode']}:\n{logs.stdout}{logs.stderr}"
        assert time.monotonic() < deadline, f"{container} not healthy in {timeout} s:\n{logs.stdout}{logs.stderr}"
        time.sleep(1)


class Container:
    """The CPU image run as a user runs it (its own CMD), on the host's network, moved to free 127.0.0.1 ports."""

    def __init__(self, env: dict) -> None:
        self.env = env
        self.name = f"llm-test-{uuid.uuid4().hex[:8]}"
        self.http_port, self.grpc_port, self.metrics_port, self.openai_port = free_ports(4)
        self.http_url = f"http://{LOCALHOST}:{self.http_port}"
        self.grpc_url = f"{LOCALHOST}:{self.grpc_port}"
        self.metrics_url = f"http://{LOCALHOST}:{self.metrics_port}/metrics"
        cmd = json.loads(run("docker", "image", "inspect", "--format", "{{json .Config.Cmd}}", TRITON_IMAGE,
                             env=env).stdout)
        split = cmd.index("--")
        # NOTE: only the listening address is added: on the host's network the image's 0.0.0.0 would be every
        # interface of this machine.
        cmd = [*cmd[:split], "--address", LOCALHOST, *cmd[split:]]
        run("docker", "run", "-d", "--name", self.name, "--network", "host", "--shm-size", "1g",
            "-e", f"HTTP_PORT={self.http_port}", "-e", f"GRPC_PORT={self.grpc_port}",
            "-e", f"METRICS_PORT={self.metrics_port}", "-e", f"OPENAI_PORT={self.openai_port}", TRITON_IMAGE, *cmd,
            env=env)

    def state(self) -> dict:
        return json.loads(run("docker", "inspect", "--format", "{{json .State}}", self.name, env=self.env).stdout)

    def logs(self) -> list[str]:
        result = run("docker", "logs", self.name, env=self.env, check=False)
        return (result.stdout + result.stderr).splitlines()

    def remove(self) -> None:
        run("docker", "rm", "-f", self.name, env=self.env, check=False)


@pytest.fixture(scope="module")
def container(docker_env):
    started = Container(docker_env)
    try:
        healthy(started.name, docker_env, timeout=300)
        yield started
    finally:
        started.remove()


def generate(url: str, model: str, prompt: str, max_tokens: int = 24) -> dict:
    body = {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = requests.post(f"{url}/v2/models/{model}/generate", json=body, timeout=300)
    assert response.status_code == 200, (model, response.text)
    return response.json()


# ---- the image ------------------------------------------------------------------------------------------------


def test_cpu_image_holds_the_venvs_server_and_no_cuda(docker_env):
    config = json.loads(run("docker", "image", "inspect", "--format", "{{json .Config}}", TRITON_IMAGE,
                            env=docker_env).stdout)
    assert config["User"].split(":")[0] not in ("", "root", "0")
    assert set(config["ExposedPorts"]) == {"8000/tcp", "8001/tcp", "8002/tcp", "9000/tcp"}
    assert "probe.py" in " ".join(config["Healthcheck"]["Test"])
    packages = json.loads(run("docker", "run", "--rm", "--network", "none", TRITON_IMAGE,
                              "python3", "-m", "pip", "list", "--format", "json", env=docker_env).stdout)
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in packages}
    assert installed["torch"].endswith("+cpu"), installed["torch"]
    cuda = sorted(n for n in installed
                  if n.startswith(("nvidia-", "cuda-")) and n != "nvidia-pytriton" or n == "triton")
    assert not cuda, f"CUDA packages in the CPU image: {cuda}"
    # The server the tests run: the same tritonserver wheel, torch and transformers as this virtual environment.
    from importlib import metadata

    for name in ("nvidia-pytriton", "torch", "transformers", "tokenizers", "numpy"):
        assert installed[name] == metadata.version(name), name
    size = int(run("docker", "image", "inspect", "--format", "{{.Size}}", TRITON_IMAGE, env=docker_env).stdout)
    print(f"\n{TRITON_IMAGE}: {size / 1e9:.2f} GB")


def test_container_is_ready_and_every_model_answers(container):
    assert requests.get(f"{container.http_url}/v2/health/ready", timeout=5).status_code == 200
    version = requests.get(f"{container.http_url}/v2", timeout=5).json()["version"]
    assert version == "2.51.0"
    for model in MODELS:
        out = generate(container.http_url, model, PROMPTS[0], max_tokens=8)
        assert out["num_output_tokens"] == 8 and out["finish_reason"] == "length", (model, out)
    # The OpenAI-compatible frontend that `make serve` starts beside tritonserver, in the container too.
    openai_url = f"http://{LOCALHOST}:{container.openai_port}/v1"
    listed = requests.get(f"{openai_url}/models", timeout=10).json()
    assert sorted(m["id"] for m in listed["data"]) == sorted(MODELS)
    chat = requests.post(f"{openai_url}/chat/completions", timeout=120, json={
        "model": "llm_continuous", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 6 and chat["choices"][0]["finish_reason"] == "length", chat
    metrics = requests.get(container.metrics_url, timeout=5).text
    for model in MODELS:
        assert re.search(rf'^llm_engine_healthy{{[^}}]*model="{model}"[^}}]*}} 1', metrics, re.M), model


def test_greedy_text_from_the_container_equals_the_venv_server(container, start_server, smollm2_dir):
    """The same model, engine and server in a container and in the virtual environment give the same tokens."""
    local = start_server(REPO_ROOT / "model_repository", model=smollm2_dir)
    for model in MODELS:
        for prompt in PROMPTS:
            theirs = generate(container.http_url, model, prompt)
            ours = generate(local.http_url, model, prompt)
            assert theirs["output_ids"] == ours["output_ids"], (
                model, prompt, theirs["text_output"], ours["text_output"])
            assert theirs["text_output"] == ours["text_output"]
            assert len(theirs["output_ids"]) == 24


def test_docker_stop_under_locust_load_drains_and_exits_0(container, tmp_path):
    """`docker stop` while Locust streams from three models: exit status 0 within the grace, every model
    unloaded, every request a model accepted answered once (its last token, or "the server is shutting down")."""
    locusts = {}
    before = MetricsTrail(container.metrics_url)
    time.sleep(1)
    earlier = before.stop()  # what the tests before this one asked of each model
    try:
        for model, users in (("llm_continuous", 4), ("llm_dynamic", 2), ("llm_iterative", 2)):
            locusts[model] = start_locust((container.http_url, container.grpc_url), model, users, tmp_path)
        time.sleep(10)  # load: the engines are busy and keep-alive connections are open
        assert all(p.poll() is None for p in locusts.values()), "a Locust run ended before docker stop"
        trail = MetricsTrail(container.metrics_url)
        t0 = time.monotonic()
        run("docker", "stop", "-t", str(STOP_GRACE_S), container.name, env=container.env, timeout=STOP_GRACE_S + 30)
        stop_s = time.monotonic() - t0
        last = trail.stop()
        for locust in locusts.values():
            locust.wait(120)  # they go on until their budget or run time is spent, meeting refusals
    finally:
        for locust in locusts.values():
            if locust.poll() is None:
                locust.kill()
    state = container.state()
    lines = container.logs()
    unloaded = unload_times(lines, "Signal (")
    print(f"\ndocker stop: exit status {state['ExitCode']} after {stop_s:.1f} s; unloaded {unloaded}")
    assert state["ExitCode"] == 0 and not state["OOMKilled"], "\n".join(lines[-40:])
    assert stop_s < 35, "\n".join(lines[-40:])  # inside the 30-s exit timeout, not killed at the grace's end
    assert set(unloaded) == set(MODELS), unloaded
    for model in locusts:
        records = requests_of(tmp_path / f"{model}.jsonl")
        outcomes = Counter("ok" if r["ok"] else "cut" if r["cut"] else "shutting down" if SHUTTING_DOWN in
                           (r["error"] or "") else "other error" for r in records)
        final = last[model]
        print(f"  {model}: {dict(outcomes)}; server at unload: {dict(final)}")
        assert final["llm_kv_blocks_used"] == 0
        assert final["llm_num_requests_running"] == final["llm_num_requests_waiting"] == 0
        assert outcomes["ok"] > 0 and outcomes["cut"] == 0, (model, outcomes)
        streamed = [r for r in records if r["num_output_tokens"] > 0]
        assert not [r for r in streamed if not r["ok"] and SHUTTING_DOWN not in (r["error"] or "")], model
        finished = final["llm_request_success_total"] - earlier.get(model, {}).get("llm_request_success_total", 0)
        assert finished == len(streamed), (model, final, earlier.get(model), len(streamed))


# ---- Compose --------------------------------------------------------------------------------------------------


def prometheus_image(env: dict) -> str | None:
    """None when compose.yaml's own Prometheus image is here or can be pulled; else the stand-in, built."""
    image = yaml.safe_load(COMPOSE_FILES[0].read_text())["services"]["prometheus"]["image"]
    if run("docker", "image", "inspect", image, env=env, check=False).returncode == 0:
        return None
    if run("docker", "pull", "-q", image, env=env, timeout=600, check=False).returncode == 0:
        return None
    dockerfile = REPO_ROOT / "tests" / "docker" / "prometheus.Dockerfile"
    run("docker", "buildx", "build", "--load", "--network", "host", "-f", str(dockerfile), "-t", PROMETHEUS_STAND_IN,
        str(dockerfile.parent), env=env, timeout=900)
    return PROMETHEUS_STAND_IN


def compose_override(tmp_path: Path, env: dict, locust_run_s: int) -> tuple[Path, dict]:
    """The test's override: every service on the host's network and free 127.0.0.1 ports, Locust headless over every
    model for a bounded run, Prometheus scraping Triton there. Returns the file and the ports."""
    http, grpc, metrics, prometheus, master, openai = free_ports(6)
    ports = {"http": http, "grpc": grpc, "metrics": metrics, "prometheus": prometheus, "openai": openai}
    scrape = yaml.safe_load((REPO_ROOT / "docker" / "prometheus.yml").read_text())
    scrape["scrape_configs"][0]["static_configs"] = [{"targets": [f"{LOCALHOST}:{metrics}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(scrape))
    host = {"network_mode": "host", "ports": "RESET"}
    services = {
        "triton": {**host,
                   "environment": {"HTTP_PORT": str(http), "GRPC_PORT": str(grpc), "METRICS_PORT": str(metrics)},
                   "command": ["python3", "-m", "backend.triton.launcher.serve",
                               "--model-repository=/opt/llm/model_repository",
                               "--address", LOCALHOST, "--openai-port", str(openai), "--",
                               "--exit-timeout-secs=30"]},
        "locust-master": {**host, "command": [
            "-f", "loadtest/locustfile.py", "--master", "--master-bind-host", LOCALHOST, "--master-bind-port",
            str(master), "--headless", "--expect-workers", "2", "-u", "8", "-r", "8", "--run-time", f"{locust_run_s}s",
            "--stop-timeout", "60", "--host", f"http://{LOCALHOST}:{http}", "--grpc-url", f"{LOCALHOST}:{grpc}",
            "--model", ",".join(MODELS), "--length-scale", "0.25", "--json"]},
        "locust-worker": {"network_mode": "host", "command": [
            "-f", "loadtest/locustfile.py", "--worker", "--master-host", LOCALHOST, "--master-port", str(master)]},
        "prometheus": {**host, "volumes": "OVERRIDE", "command": [
            "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus",
            f"--web.listen-address={LOCALHOST}:{prometheus}"]},
    }
    stand_in = prometheus_image(env)
    if stand_in:
        services["prometheus"]["image"] = stand_in
    text = yaml.safe_dump({"services": services}, sort_keys=False)
    text = text.replace("ports: RESET", "ports: !reset []").replace(
        "volumes: OVERRIDE",
        f"volumes: !override\n    - {tmp_path / 'prometheus.yml'}:/etc/prometheus/prometheus.yml:ro")
    path = tmp_path / "compose.test.yaml"
    path.write_text(text)
    return path, ports


def test_compose_stack_serves_locust_and_prometheus_and_stops_cleanly(docker_env, tmp_path):
    """`docker compose up` of the CPU stack: the Locust workers drive every model through the master (headless,
    bounded), Prometheus scrapes Triton's llm_* series, and `docker compose down` ends Triton with exit status 0
    within its grace."""
    override, ports = compose_override(tmp_path, docker_env, locust_run_s=45)
    project = f"llmtest{uuid.uuid4().hex[:6]}"
    compose = ["docker", "compose", "-p", project, *(a for f in (*COMPOSE_FILES, override) for a in ("-f", str(f)))]
    triton_exit: dict = {}
    try:
        run(*compose, "up", "-d", "--no-build", env=docker_env, timeout=600)
        ids = {service: run(*compose, "ps", "-a", "-q", service, env=docker_env).stdout.split()
               for service in ("triton", "locust-master", "locust-worker", "prometheus")}
        assert len(ids["locust-worker"]) == 2, ids
        master = ids["locust-master"][0]
        code = int(run("docker", "wait", master, env=docker_env, timeout=600).stdout.strip())
        out = run("docker", "logs", master, env=docker_env)
        assert code == 0, out.stderr[-4000:]
        stats = json.loads(out.stdout[out.stdout.index("["):])
        by_name = {s["name"]: s for s in stats}
        for model in MODELS:
            entry = by_name[f"{model} (e2e)"]
            print(f"  {model}: {entry['num_requests']} requests, {entry['num_failures']} failures")
            assert entry["num_requests"] > 0 and entry["num_failures"] == 0, entry

        prometheus_url = f"http://{LOCALHOST}:{ports['prometheus']}/api/v1/query"
        deadline = time.monotonic() + 60
        while True:  # the last scrape after the run's end (every 5 s)
            result = requests.get(prometheus_url, params={"query": "sum by (model) (llm_request_success_total)"},
                                  timeout=10).json()["data"]["result"]
            served = {r["metric"]["model"]: float(r["value"][1]) for r in result}
            if all(served.get(model, 0) >= by_name[f"{model} (e2e)"]["num_requests"] for model in MODELS):
                break
            assert time.monotonic() < deadline, f"Prometheus has {served}; Locust finished {by_name}"
            time.sleep(2)
        print(f"  Prometheus: llm_request_success_total by model {served}")

        # `docker wait` reports Triton's exit status before `down` removes the container.
        waiter = threading.Thread(target=lambda: triton_exit.update(
            code=int(run("docker", "wait", ids["triton"][0], env=docker_env, timeout=120).stdout.strip())))
        waiter.start()
        t0 = time.monotonic()
        run(*compose, "down", env=docker_env, timeout=STOP_GRACE_S + 60)
        down_s = time.monotonic() - t0
        waiter.join(30)
        print(f"  docker compose down: {down_s:.1f} s, Triton exit status {triton_exit.get('code')}")
        assert triton_exit.get("code") == 0
        assert down_s < STOP_GRACE_S
    finally:
        run(*compose, "down", "-t", "5", "-v", env=docker_env, timeout=120, check=False)
