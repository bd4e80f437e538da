"""The admin APIs that can make the server open a name or a path, or load a model, need the admin key.

The launcher passes Triton's own ``--http-restricted-api`` / ``--grpc-restricted-protocol`` flags
(backend.triton.launcher.serve). The restriction is in Triton's HTTP and gRPC front ends, before any model runs, so
the small echo repository of tests/server/test_launcher.py stands in for the LLM models here (its stubs do not import
torch).
tests/unit/test_security.py checks the flags and the key without a server.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import requests

from backend.contract.settings import ADMIN_KEY_ENV_VAR
from backend.triton.launcher.serve import TritonServer
from tests.server.test_launcher import write_echo_repository

ADMIN_KEY = "test-admin-key-" + os.urandom(8).hex()
HTTP_REFUSAL = "This API is restricted, expecting header 'admin-key'"
GRPC_REFUSAL = "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"


@pytest.fixture(scope="module")
def server(triton_server_factory, tmp_path_factory) -> TritonServer:
    """The launcher's default restriction, with the key taken from the server's environment."""
    repository = write_echo_repository(tmp_path_factory.mktemp("echo-repository"))
    server = triton_server_factory.start(repository, env={ADMIN_KEY_ENV_VAR: ADMIN_KEY})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def explicit_server(triton_server_factory, tmp_path_factory) -> TritonServer:
    """Explicit model control: load and unload exist, so model-repository is restricted too (random key)."""
    repository = write_echo_repository(tmp_path_factory.mktemp("echo-repository"))
    server = triton_server_factory.start(repository, extra_args=["--model-control-mode=explicit", "--load-model=*"])
    yield server
    server.stop()


def grpc_client(server: TritonServer):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(server.grpc_url)


# ---- refused without the key -------------------------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.timeout(120)
def test_http_log_settings_are_refused_and_no_file_is_created(server, tmp_path):
    log_file = tmp_path / "log-from-a-request.txt"
    for body in ({"log_file": str(log_file)}, {"log_verbose_level": 1}):
        reply = requests.post(f"{server.http_url}/v2/logging", json=body, timeout=10)
        assert reply.status_code == 403 and reply.json()["error"] == HTTP_REFUSAL
    assert requests.get(f"{server.http_url}/v2/logging", timeout=10).status_code == 403
    assert not log_file.exists()


@pytest.mark.server
@pytest.mark.timeout(120)
def test_http_trace_settings_are_refused_and_no_file_is_created(server, tmp_path):
    trace_file = tmp_path / "trace-from-a-request.json"
    body = {"trace_file": str(trace_file), "trace_level": ["TIMESTAMPS"], "trace_rate": "1"}
    for url in (f"{server.http_url}/v2/trace/setting", f"{server.http_url}/v2/models/upper/trace/setting"):
        reply = requests.post(url, json=body, timeout=10)
        assert reply.status_code == 403 and reply.json()["error"] == HTTP_REFUSAL, url
    assert not trace_file.exists()


@pytest.mark.server
@pytest.mark.timeout(120)
def test_http_shared_memory_registration_is_refused(server):
    # NOTE: a name the server would open: the stubs' own regions sit in /dev/shm under guessable names.
    body = {"key": "/triton_python_backend_shm_region_x", "offset": 0, "byte_size": 64}
    reply = requests.post(f"{server.http_url}/v2/systemsharedmemory/region/x/register", json=body, timeout=10)
    assert reply.status_code == 403 and reply.json()["error"] == HTTP_REFUSAL
    assert requests.get(f"{server.http_url}/v2/systemsharedmemory/status", timeout=10).status_code == 403
    reply = requests.post(f"{server.http_url}/v2/cudasharedmemory/region/x/register", json={}, timeout=10)
    assert reply.status_code == 403


@pytest.mark.server
@pytest.mark.timeout(120)
def test_grpc_admin_calls_are_refused(server, tmp_path):
    from tritonclient.utils import InferenceServerException

    client = grpc_client(server)
    calls = {
        "register shared memory": lambda: client.register_system_shared_memory("x", "/x", 64),
        "shared memory status": lambda: client.get_system_shared_memory_status(),
        "log settings": lambda: client.get_log_settings(),
        "update log settings": lambda: client.update_log_settings({"log_file": str(tmp_path / "grpc.log")}),
        "update trace settings": lambda: client.update_trace_settings(settings={"trace_file": str(tmp_path / "t")}),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(InferenceServerException) as refused:
                call()
            # NOTE: Triton 2.51 answers a missing or wrong key with UNAVAILABLE, not PERMISSION_DENIED.
            assert refused.value.message() == GRPC_REFUSAL, name
            assert refused.value.status() == "StatusCode.UNAVAILABLE", name
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_log_settings(headers={"triton-grpc-protocol-admin-key": "wrong"})
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_log_settings(headers={"admin-key": ADMIN_KEY})  # the HTTP header name is not the gRPC one
    finally:
        client.close()
    assert not list(tmp_path.iterdir())


@pytest.mark.server
@pytest.mark.timeout(120)
def test_model_control_needs_the_key(explicit_server):
    url = explicit_server.http_url
    for path in ("/v2/repository/index", "/v2/repository/models/upper/unload", "/v2/repository/models/upper/load"):
        reply = requests.post(url + path, json={}, timeout=10)
        assert reply.status_code == 403 and reply.json()["error"] == HTTP_REFUSAL, path
    assert requests.get(f"{url}/v2/models/upper/ready", timeout=10).status_code == 200

    from tritonclient.utils import InferenceServerException

    client = grpc_client(explicit_server)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.unload_model("upper")
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_repository_index()
        # With the key, model control works as before.
        assert [m.name for m in client.get_model_repository_index(headers=explicit_server.admin_grpc_headers).models]
    finally:
        client.close()
    reply = requests.post(f"{url}/v2/repository/models/words/unload", headers=explicit_server.admin_headers, timeout=60)
    assert reply.status_code == 200, reply.text
    reply = requests.post(f"{url}/v2/repository/models/words/load", headers=explicit_server.admin_headers, timeout=60)
    assert reply.status_code == 200, reply.text


# ---- with the key, and what needs none ------------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.timeout(120)
def test_the_key_opens_the_admin_apis(server):
    assert server.admin_key == ADMIN_KEY
    reply = requests.get(f"{server.http_url}/v2/logging", headers={"admin-key": ADMIN_KEY}, timeout=10)
    assert reply.status_code == 200 and reply.json()["log_file"] == ""
    assert requests.get(f"{server.http_url}/v2/logging", headers={"admin-key": "wrong"}, timeout=10).status_code == 403

    client = grpc_client(server)
    try:
        settings = client.get_log_settings(headers=server.admin_grpc_headers, as_json=True)["settings"]
        assert settings["log_info"]["bool_param"] is True
    finally:
        client.close()
    assert ADMIN_KEY not in "\n".join(server.output_lines())


@pytest.mark.server
@pytest.mark.timeout(120)
def test_inference_health_metadata_and_metrics_need_no_key(server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    url = server.http_url
    for path in ("/v2/health/ready", "/v2/health/live", "/v2", "/v2/models/upper", "/v2/models/upper/config",
                 "/v2/models/upper/stats"):
        assert requests.get(url + path, timeout=10).status_code == 200, path
    reply = requests.post(f"{url}/v2/models/upper/generate", json={"text_input": "no key"}, timeout=30)
    assert reply.status_code == 200 and reply.json()["text_output"] == "NO KEY"
    assert requests.get(server.metrics_url, timeout=10).status_code == 200

    client = httpclient.InferenceServerClient(f"{server.address}:{server.http_port}")
    text = httpclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"http client"], dtype=np.object_))
    assert client.infer("upper", [text]).as_numpy("text_output")[0] == b"HTTP CLIENT"
    client.close()

    client = grpc_client(server)
    try:
        assert client.is_server_ready() and client.get_server_metadata().version == "2.51.0"
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"grpc client"], dtype=np.object_))
        assert client.infer("upper", [text], client_timeout=30).as_numpy("text_output")[0] == b"GRPC CLIENT"
    finally:
        client.close()
