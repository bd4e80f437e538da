# vLLM's router (PyPI: vllm-router, a Rust binary with a Python launcher) in front of the Triton replicas' OpenAI
# frontends: routes /v1/completions and /v1/chat/completions by prefix and load (cache_aware), health-checks the
# replicas, retries a request a replica refused or could not take, and serves its own Prometheus metrics.
#
#   docker buildx build -f docker/router.Dockerfile -t llm-batching-router:latest .      (from the repository root)
#
# The base of every image of the project; a certificate authority for pip: `--secret id=ca,src=FILE`
# (docker/pip-install.sh). docker/README.md, "Several replicas behind a router", says why this router.
FROM python:3.11-slim-bookworm

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

COPY docker/pip-install.sh /usr/local/bin/pip-install
COPY docker/requirements-router.txt /tmp/requirements-router.txt
RUN --mount=type=bind,source=docker/wheels,target=/wheels --mount=type=secret,id=ca \
    python3 -m venv "$VIRTUAL_ENV" \
    && pip-install --no-deps -r /tmp/requirements-router.txt \
    && rm /tmp/requirements-router.txt

RUN useradd --no-log-init --create-home --uid 10001 --user-group router
USER 10001:10001

# The OpenAI API (--port), the router's Prometheus metrics (--prometheus-port).
EXPOSE 8080 29000

ENTRYPOINT ["vllm-router"]
CMD ["--help"]
