# Locust load generator running loadtest/locustfile.py (the master and every worker use this image).
#
#   docker buildx build -f docker/locust.Dockerfile -t llm-batching-locust:latest .      (from the repository root)
#
# The same base as the CPU Triton image (python:3.11-slim-bookworm) and Python 3.11 like the project's virtual
# environment, so docker/requirements-locust.txt pins exactly what requirements.txt pins (tests/unit/test_deploy.py checks
# it). No torch: the load generator only speaks tritonclient. A certificate authority for pip: `--secret id=ca,src=FILE`
# (docker/pip-install.sh).
FROM python:3.11-slim-bookworm

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

COPY docker/pip-install.sh /usr/local/bin/pip-install
COPY docker/requirements-locust.txt /tmp/requirements-locust.txt
RUN --mount=type=bind,source=docker/wheels,target=/wheels --mount=type=secret,id=ca \
    python3 -m venv "$VIRTUAL_ENV" \
    && pip-install -r /tmp/requirements-locust.txt \
    && rm /tmp/requirements-locust.txt

WORKDIR /opt/llm
COPY loadtest/ loadtest/
COPY client/ client/
# What the load tests share with the server (backend/contract: the names of models and metrics, the metrics parser,
# the errors' codes): standard library alone.
COPY backend/__init__.py backend/
COPY backend/contract/ backend/contract/

RUN useradd --no-log-init --create-home --uid 10001 --user-group locust
USER 10001:10001
ENV PYTHONPATH=/opt/llm

# Web UI, and the port workers connect to on the master.
EXPOSE 8089 5557

ENTRYPOINT ["locust"]
CMD ["-f", "loadtest/locustfile.py", "--help"]
