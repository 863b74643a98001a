#!/usr/bin/env bash
# A llama-chat cluster on this machine's loopback: a Redis Cluster (3 primaries, 3 replicas), N
# `llama-chat serve`s, each on its own database and sharing KV blocks through the cluster
# (--kv-remote), and HAProxy in front (deploy/haproxy.cfg). docs/scale-out.md says what each part does.
#
#   deploy/local-cluster.sh [--servers N] [--dir DIR] [--model M] [-- OPTIONS...]
#       starts it; the last line printed is the balancer's base URL, once every server answers
#       /health. OPTIONS go to every `llama-chat serve` (e.g. --threads 1 --block-size 16).
#   deploy/local-cluster.sh --add-server [--dir DIR]
#       one server more, with the same options, added to the running balancer (which keeps its table).
#   deploy/local-cluster.sh --stop [--dir DIR]
#       ends what the start began (by its pid files) and frees every port it took.
#
# DIR (default $XDG_RUNTIME_DIR/llama-chat-cluster, else /tmp/llama-chat-cluster) holds pids/, logs/,
# each server's database, and the files the commands read back: servers (name port), redis-ports,
# balancer (port), serve-args, secret. $LLAMA_CHAT names the llama-chat command (default: on PATH).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
LLAMA_CHAT=${LLAMA_CHAT:-llama-chat}
DIR=${XDG_RUNTIME_DIR:-/tmp}/llama-chat-cluster
SERVERS=3
MODEL=""
ACTION=start
WAIT_S=${LLAMA_CLUSTER_WAIT_S:-900}  # for every server to load its model (a first start compiles)
OPTIONS=()

say() { echo "local-cluster: $*" >&2; }
die() { say "$*"; exit 1; }

while (($#)); do
    case $1 in
        --servers) SERVERS=${2:?--servers needs a number}; shift 2 ;;
        --dir) DIR=${2:?--dir needs a folder}; shift 2 ;;
        --model) MODEL=${2:?--model needs a model}; shift 2 ;;
        --stop) ACTION=stop; shift ;;
        --add-server) ACTION=add; shift ;;
        --) shift; OPTIONS=("$@"); break ;;
        -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
[[ $SERVERS =~ ^[1-9][0-9]*$ ]] || die "--servers must be 1 or more, not '$SERVERS'"

# -- processes, by pid file --------------------------------------------------------------------------

alive() {  # alive PIDFILE WORD: the process of the pid file runs, and its command line holds WORD
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$2"
}

end() {  # end PIDFILE WORD SECONDS: SIGTERM, then SIGKILL after SECONDS; the pid file removed
    local pidfile=$1 word=$2 patience=$3 pid
    if alive "$pidfile" "$word"; then
        pid=$(<"$pidfile")
        kill -TERM "$pid" 2>/dev/null || true
        for ((t = 0; t < patience * 10; t++)); do
            alive "$pidfile" "$word" || break
            sleep 0.1
        done
        if alive "$pidfile" "$word"; then
            say "$word (pid $pid) did not stop in ${patience} s: killing it"
            kill -KILL "$pid" 2>/dev/null || true
            while alive "$pidfile" "$word"; do sleep 0.1; done
        fi
    fi
    rm -f "$pidfile"
}

stop() {
    [[ -d $DIR/pids ]] || { say "nothing started in $DIR"; return 0; }
    end "$DIR/pids/haproxy.pid" haproxy 10
    for pidfile in "$DIR"/pids/s[0-9]*.pid; do
        [[ -e $pidfile ]] && end "$pidfile" serve 40 &  # each drains its replies (--drain-seconds)
    done
    wait
    for pidfile in "$DIR"/pids/redis-*.pid; do
        [[ -e $pidfile ]] && end "$pidfile" redis-server 10
    done
    say "stopped what $DIR held"
}

# -- ports and the parts -----------------------------------------------------------------------------

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_ports() {  # N loopback ports nothing listens on, nor on port + 10000 (a Redis Cluster's bus)
    # below the range the kernel takes outgoing connections' ports from, where no connection holds one
    local ports=() port low span
    read -r low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || low=32768
    span=$((low - 20000))
    ((span >= 1000)) || span=10000
    while ((${#ports[@]} < $1)); do
        port=$((10000 + RANDOM % span))
        listening "$port" || listening $((port + 10000)) || [[ " ${ports[*]} " == *" $port "* ]] || ports+=("$port")
    done
    echo "${ports[@]}"
}

health() {  # health PORT: the status code of GET /health on 127.0.0.1:PORT (000: no answer)
    local line=""
    {
        exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'GET /health HTTP/1.0\r\n\r\n' >&3 && read -r -t 5 line <&3
        exec 3>&-
    } 2>/dev/null || true
    [[ $line =~ ^HTTP/1\.[01]\ ([0-9]{3}) ]] && echo "${BASH_REMATCH[1]}" || echo 000
}

start_redis() {
    local ports=("$@") port
    mkdir -p "$DIR/redis"
    rm -f "$DIR"/redis/nodes-*.conf  # a fresh cluster each time
    for port in "${ports[@]}"; do
        redis-server --port "$port" --bind 127.0.0.1 --dir "$DIR/redis" \
            --cluster-enabled yes --cluster-config-file "nodes-$port.conf" --cluster-node-timeout 2000 \
            --save "" --appendonly no --maxmemory 512mb --maxmemory-policy allkeys-lru \
            --daemonize yes --pidfile "$DIR/pids/redis-$port.pid" --logfile "$DIR/logs/redis-$port.log"
    done
    for port in "${ports[@]}"; do
        for ((t = 0; t < 100; t++)); do
            redis-cli -p "$port" ping >/dev/null 2>&1 && break
            sleep 0.1
        done
    done
    printf '%s\n' "${ports[@]}" >"$DIR/redis-ports"
    local nodes=()
    for port in "${ports[@]}"; do nodes+=("127.0.0.1:$port"); done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$DIR/logs/redis-cluster.log" 2>&1 \
        || die "redis-cli --cluster create failed: $DIR/logs/redis-cluster.log"
    for port in "${ports[@]}"; do
        for ((t = 0; ; t++)); do
            redis-cli -p "$port" cluster info 2>/dev/null | grep -q '^cluster_state:ok' && break
            ((t < 300)) || die "the Redis Cluster did not come up: $DIR/logs/redis-*.log"
            sleep 0.1
        done
    done
}

write_start() {  # write_start NAME PORT: DIR/NAME.start, which starts that server as this script does
    local name=$1 port=$2 args
    mkdir -p "$DIR/$name"
    args=$(<"$DIR/serve-args")
    cat >"$DIR/$name.start" <<EOF
#!/usr/bin/env bash
# Starts $name as deploy/local-cluster.sh did: its pid in pids/$name.pid, its log in logs/$name.log.
cd $(printf %q "$DIR")
LLAMA_CHAT_KV_SECRET=\$(<secret) $args --port $port --db $(printf %q "$DIR/$name/chat.db") \\
    </dev/null >>logs/$name.log 2>&1 &
echo \$! >pids/$name.pid
EOF
    chmod +x "$DIR/$name.start"
}

start_server() {  # start_server NAME PORT
    write_start "$1" "$2"
    "$DIR/$1.start"
    echo "$1 $2" >>"$DIR/servers"
}

wait_ready() {  # every server in DIR/servers answers /health with 200
    local name port tries deadline=$((SECONDS + WAIT_S))
    while read -r name port; do
        tries=0
        until [[ $(health "$port") == 200 ]]; do
            if ! alive "$DIR/pids/$name.pid" serve; then
                # Another process took its port after free_ports found it free: start it on another.
                grep -q "Address already in use" <(tail -3 "$DIR/logs/$name.log") && ((++tries <= 3)) ||
                    die "$name stopped while starting: $(tail -3 "$DIR/logs/$name.log")"
                port=$(free_ports 1)
                say "$name lost its port to another process: starting it on $port"
                write_start "$name" "$port"
                "$DIR/$name.start"
                sed -i "s/^$name .*/$name $port/" "$DIR/servers"
            fi
            ((SECONDS < deadline)) || die "$name is not ready after ${WAIT_S} s: $DIR/logs/$name.log"
            sleep 0.5
        done
    done <"$DIR/servers"
}

write_balancer() {  # DIR/haproxy.cfg: deploy/haproxy.cfg, a server line for each server, the admin port
    local name port
    {
        cat "$HERE/haproxy.cfg"
        while read -r name port; do
            echo "    server $name 127.0.0.1:$port"
        done <"$DIR/servers"
        printf 'global\n    stats socket ipv4@127.0.0.1:%s level admin\n' "$(cut -d' ' -f3 "$DIR/balancer")"
    } >"$DIR/haproxy.cfg"
}

admin() {  # admin COMMANDS: HAProxy's answer on its runtime API (commands separated by ';')
    local port
    port=$(cut -d' ' -f3 "$DIR/balancer")
    { exec 3<>"/dev/tcp/127.0.0.1/$port" && printf '%s\n' "$1" >&3 && cat <&3; } 2>/dev/null || true
}

balancer() {  # HAProxy on DIR/haproxy.cfg with the ports of DIR/balancer
    local port peer
    read -r port peer _ <"$DIR/balancer"
    LLAMA_BALANCER_BIND=127.0.0.1:$port LLAMA_BALANCER_PEER=127.0.0.1:$peer \
        haproxy -f "$DIR/haproxy.cfg" -L local -D -p "$DIR/pids/haproxy.pid" 2>>"$DIR/logs/haproxy.log" \
        || die "haproxy did not start: $DIR/logs/haproxy.log"
    echo "http://127.0.0.1:$port"
}

start() {
    for tool in redis-server redis-cli haproxy; do
        command -v "$tool" >/dev/null || die "$tool is not installed (apt-get install redis-server haproxy)"
    done
    command -v "$LLAMA_CHAT" >/dev/null || die "$LLAMA_CHAT is not installed (or set LLAMA_CHAT)"
    if compgen -G "$DIR/pids/*.pid" >/dev/null; then
        die "$DIR holds a cluster already: stop it first (--stop --dir $DIR)"
    fi
    mkdir -p "$DIR/pids" "$DIR/logs"
    rm -f "$DIR/servers"
    trap 'status=$?; if ((status)); then say "failed: stopping what was started"; stop; fi' EXIT
    local ports
    read -r -a ports <<<"$(free_ports $((6 + SERVERS)))"
    start_redis "${ports[@]:0:6}"
    (
        umask 077  # the secret that signs the KV blocks: readable by this user only
        if [[ -n ${LLAMA_CHAT_KV_SECRET:-} ]]; then
            printf %s "$LLAMA_CHAT_KV_SECRET"
        else
            od -An -tx1 -N32 /dev/urandom | tr -d ' \n'
        fi >"$DIR/secret"
    )
    local args=("$LLAMA_CHAT" serve --kv-remote "redis+cluster://127.0.0.1:${ports[0]}")
    [[ -n $MODEL ]] && args+=(--model "$MODEL")
    args+=("${OPTIONS[@]}")
    printf '%q ' "${args[@]}" >"$DIR/serve-args"
    for ((i = 1; i <= SERVERS; i++)); do
        start_server "s$i" "${ports[5 + i]}"
    done
    wait_ready
    free_ports 3 >"$DIR/balancer"  # chosen as late as can be: until HAProxy binds, another may take one
    write_balancer
    say "Redis Cluster on 127.0.0.1:$(paste -sd, "$DIR/redis-ports"); servers: $(paste -sd, "$DIR/servers")"
    balancer
    trap - EXIT
}

add_server() {
    [[ -s $DIR/servers ]] && alive "$DIR/pids/haproxy.pid" haproxy || die "no cluster runs in $DIR"
    local n port reply
    n=$(($(wc -l <"$DIR/servers") + 1))
    port=$(free_ports 1)
    start_server "s$n" "$port"
    wait_ready
    read -r _ port < <(grep "^s$n " "$DIR/servers")  # (wait_ready moves a server whose port was taken)
    write_balancer  # the file says what runs, for HAProxy's next start
    # Into the running HAProxy through its runtime API, not by a reload: its table of which server
    # holds which conversation stays whole. (A server added so takes no default-server line.)
    reply=$(admin "add server llama-chat/s$n 127.0.0.1:$port check inter 1s fall 3 rise 2")
    [[ $reply == *"New server registered"* ]] || die "haproxy did not take s$n: $reply"
    admin "enable health llama-chat/s$n" >/dev/null
    admin "enable server llama-chat/s$n" >/dev/null
    for ((t = 0; t < 100; t++)); do  # until its checks find it up
        admin "show servers state llama-chat" | awk -v s="s$n" '$4 == s && $6 == 2 { up = 1 } END { exit !up }' \
            && break
        sleep 0.1
    done
    echo "http://127.0.0.1:$(cut -d' ' -f1 "$DIR/balancer")"
}

case $ACTION in
    start) start ;;
    stop) stop ;;
    add) add_server ;;
esac
