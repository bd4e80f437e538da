#!/usr/bin/env bash
# The balancer image's entry point: NGINX's configuration from the environment, then NGINX in the foreground.
#
#   TRITON_HTTP   the replicas' HTTP ports, space-separated host:port (e.g. "triton-1:8000 triton-2:8000")
#   TRITON_GRPC   the replicas' gRPC ports, likewise
#   LISTEN        the address to listen on (default 0.0.0.0); HTTP_PORT, GRPC_PORT (default 8000, 8001)
#
# NOTE: least_conn, because a generation holds its connection for as long as it runs: the replica with the fewest
# open requests is the one with the shortest queue as far as a balancer that cannot read the replicas' metrics knows.
# A replica that refuses the connection is marked down for 5 s and the request goes to the next one; a request
# already sent is never sent twice (POSTs are not idempotent), so a replica that dies mid-stream ends that stream
# with an error.
set -euo pipefail

: "${TRITON_HTTP:?the replicas' HTTP ports, e.g. TRITON_HTTP=\"triton-1:8000 triton-2:8000\"}"
: "${TRITON_GRPC:?the replicas' gRPC ports, e.g. TRITON_GRPC=\"triton-1:8001 triton-2:8001\"}"
listen="${LISTEN:-0.0.0.0}"
conf=/tmp/nginx.conf

servers() { for target in $1; do echo "        server $target max_fails=1 fail_timeout=5s;"; done; }

cat > "$conf" <<CONF
worker_processes auto;
pid /tmp/nginx.pid;
error_log stderr warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path /tmp/nginx-body;
    proxy_temp_path /tmp/nginx-proxy;
    fastcgi_temp_path /tmp/nginx-fastcgi;
    uwsgi_temp_path /tmp/nginx-uwsgi;
    scgi_temp_path /tmp/nginx-scgi;
    client_max_body_size 64m;
    # zone: the open-connection counts shared by all worker processes, so least_conn sees every connection.
    upstream triton_http {
        zone triton_http 64k;
        least_conn;
$(servers "$TRITON_HTTP")
    }
    upstream triton_grpc {
        zone triton_grpc 64k;
        least_conn;
$(servers "$TRITON_GRPC")
        keepalive 64;
    }
    server {
        listen $listen:${HTTP_PORT:-8000};
        location = /balancer/health { return 200 "ok\n"; }
        location / {
            proxy_pass http://triton_http;
            # NOTE: no keep-alive to the replicas' HTTP port: an idle kept connection is one more a stopping
            # replica must wait for or close; a generation outlasts a connect on the same host many times over.
            proxy_http_version 1.1;
            proxy_buffering off;         # generate_stream's events as they come
            proxy_read_timeout 600s;
            proxy_next_upstream error timeout;
        }
    }
    server {
        listen $listen:${GRPC_PORT:-8001} http2;
        location / {
            grpc_pass grpc://triton_grpc;
            grpc_read_timeout 600s;
            grpc_send_timeout 600s;
            grpc_next_upstream error timeout;
        }
    }
}
CONF
exec nginx -c "$conf" -g "daemon off;"
