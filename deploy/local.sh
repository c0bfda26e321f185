#!/usr/bin/env bash
# N Leyline replicas and nginx on loopback, for local use, tests and benchmarks.
#
#   deploy/local.sh start N   start N replicas on ports PORT+1.. and nginx on PORT
#   deploy/local.sh add       start one more replica and reload nginx with it
#   deploy/local.sh kill I    SIGKILL replica I (1-based), as a crash would
#   deploy/local.sh stop      stop nginx and every replica
#   deploy/local.sh status    the replicas, their pids and ports
#
# Environment: LEYLINE (the binary; default target/release/leyline or leyline on PATH),
# LEYLINE_PORT (nginx's port, default 18000), LEYLINE_DEPLOY_DIR (pids, logs and the
# generated nginx.conf; default /tmp/leyline-local), LEYLINE_SERVE_ARGS (more `serve`
# flags for every replica, e.g. "--threads 1 --kv-slots 16384 --model qwen2.5-coder-0.5b").
# Clients send X-Session-Id (16-128 URL-safe characters) to keep a conversation on one
# replica; every response names the replica in X-Leyline-Upstream.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
dir=${LEYLINE_DEPLOY_DIR:-/tmp/leyline-local}
port=${LEYLINE_PORT:-18000}
bin=${LEYLINE:-}
if [[ -z $bin ]]; then
    if [[ -x $root/target/release/leyline ]]; then bin=$root/target/release/leyline; else bin=leyline; fi
fi

die() { echo "deploy/local.sh: $*" >&2; exit 1; }

replicas() { ls "$dir"/replica-*.port 2>/dev/null | wc -l; }

wait_health() { # url seconds
    local t=0
    until curl -fsS -o /dev/null "$1/health" 2>/dev/null; do
        sleep 0.2
        t=$((t + 1))
        ((t < $2 * 5)) || return 1
    done
}

start_replica() { # index
    local i=$1 p=$((port + $1))
    # shellcheck disable=SC2086
    "$bin" serve --addr "127.0.0.1:$p" ${LEYLINE_SERVE_ARGS:-} >"$dir/replica-$i.log" 2>&1 &
    echo $! >"$dir/replica-$i.pid"
    echo "$p" >"$dir/replica-$i.port"
}

write_conf() {
    local ups="" i
    for f in "$dir"/replica-*.port; do
        ups+="    server 127.0.0.1:$(cat "$f") max_fails=1 fail_timeout=10s;"$'\n'
    done
    {
        echo "worker_processes 1;"
        echo "pid $dir/nginx.pid;"
        echo "error_log $dir/nginx-error.log warn;"
        echo "events { worker_connections 1024; }"
        echo "http {"
        echo "    access_log $dir/nginx-access.log;"
        for t in client_body proxy fastcgi uwsgi scgi; do
            echo "    ${t}_temp_path $dir/tmp-$t;"
        done
        # The template's two placeholders, filled for loopback.
        while IFS= read -r line; do
            case $line in
            @UPSTREAMS@) printf '%s' "$ups" ;;
            @LISTEN@) echo "    listen 127.0.0.1:$port;" ;;
            *) echo "    $line" ;;
            esac
        done <"$here/nginx/leyline.conf.in"
        echo "}"
    } >"$dir/nginx.conf"
    nginx -t -q -c "$dir/nginx.conf" || die "nginx rejected $dir/nginx.conf"
}

case ${1:-} in
start)
    n=${2:-3}
    command -v nginx >/dev/null || die "nginx is not installed (apt-get install nginx-light)"
    command -v curl >/dev/null || die "curl is not installed"
    [[ -f $dir/nginx.pid ]] && die "already running in $dir (deploy/local.sh stop first)"
    mkdir -p "$dir"
    rm -f "$dir"/replica-*
    for i in $(seq 1 "$n"); do start_replica "$i"; done
    for i in $(seq 1 "$n"); do
        wait_health "http://127.0.0.1:$((port + i))" 300 ||
            die "replica $i did not become healthy; see $dir/replica-$i.log"
    done
    write_conf
    nginx -c "$dir/nginx.conf"
    wait_health "http://127.0.0.1:$port" 30 || die "nginx did not answer; see $dir/nginx-error.log"
    echo "nginx on http://127.0.0.1:$port in front of $n replicas (logs in $dir)"
    ;;
add)
    [[ -f $dir/nginx.pid ]] || die "not running"
    i=$(($(replicas) + 1))
    start_replica "$i"
    wait_health "http://127.0.0.1:$((port + i))" 300 || die "replica $i did not become healthy"
    write_conf
    nginx -c "$dir/nginx.conf" -s reload
    # The reload is done when the old workers are gone; a request now sees the new ring.
    sleep 1
    echo "replica $i joined on port $((port + i))"
    ;;
kill)
    [[ -f $dir/replica-${2:-x}.pid ]] || die "no replica ${2:-} (deploy/local.sh status)"
    kill -9 "$(cat "$dir/replica-$2.pid")" 2>/dev/null || true
    echo "replica $2 killed"
    ;;
stop)
    [[ -f $dir/nginx.pid ]] && nginx -c "$dir/nginx.conf" -s stop 2>/dev/null || true
    for f in "$dir"/replica-*.pid; do
        [[ -f $f ]] && kill "$(cat "$f")" 2>/dev/null || true
    done
    rm -f "$dir/nginx.pid"
    ;;
status)
    for f in "$dir"/replica-*.port; do
        i=${f##*/replica-}
        i=${i%.port}
        pid=$(cat "$dir/replica-$i.pid")
        state=down
        kill -0 "$pid" 2>/dev/null && state=up
        echo "replica $i: port $(cat "$f"), pid $pid, $state"
    done
    ;;
*)
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
