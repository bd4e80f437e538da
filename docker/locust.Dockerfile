# Locust load generator running loadtest/locustfile.py (the master and every worker use this image).
#
#   docker build -f docker/locust.Dockerfile -t llm-batching-locust .      (from the repository root)
#
# Python 3.11 like the project's virtual environment, so docker/requirements-locust.txt pins exactly what
# requirements.txt pins (tests/test_deploy.py checks it). No torch: the load generator only speaks tritonclient.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY docker/requirements-locust.txt /tmp/requirements-locust.txt
RUN python3 -m pip install --no-cache-dir -r /tmp/requirements-locust.txt \
    && rm /tmp/requirements-locust.txt

WORKDIR /opt/llm
COPY loadtest/ loadtest/
COPY client/ client/

RUN useradd --no-log-init --create-home --uid 10001 --user-group locust
USER 10001:10001
ENV PYTHONPATH=/opt/llm

# Web UI, and the port workers connect to on the master.
EXPOSE 8089 5557

ENTRYPOINT ["locust"]
CMD ["-f", "loadtest/locustfile.py", "--help"]
