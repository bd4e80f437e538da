# Test-only stand-in for prom/prometheus where no registry can be reached (tests/server/test_containers.py builds it
# only when `docker pull prom/prometheus:<tag>` fails): Debian bookworm's own Prometheus on the project's one base
# image, with the official image's entry point and defaults. docker/compose.yaml keeps naming the real image.
FROM python:3.11-slim-bookworm

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus /etc/prometheus \
    && chown nobody:nogroup /prometheus

USER 65534:65534
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
