# NGINX in front of the Triton replicas' own HTTP and gRPC ports (KServe v2 inference, generate and
# generate_stream, tritonclient's gRPC streams): least connections, a replica that refuses connections is skipped.
# A plain balancer: it knows nothing of what a request costs (docker/README.md, "Several replicas behind a router").
#
#   docker buildx build -f docker/balancer.Dockerfile -t llm-batching-balancer:latest .   (from the repository root)
#
# Debian's nginx on the base of every image of the project (which is all that can be had where no registry answers);
# docker/balancer.sh writes its configuration from the environment when the container starts.
FROM python:3.11-slim-bookworm

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends nginx \
    && rm -rf /var/lib/apt/lists/* /etc/nginx/sites-enabled/*

COPY docker/balancer.sh /usr/local/bin/balancer
RUN useradd --no-log-init --create-home --uid 10001 --user-group balancer
USER 10001:10001

# HTTP (KServe v2 and generate), gRPC: the ports of a Triton replica.
EXPOSE 8000 8001

ENTRYPOINT ["balancer"]
