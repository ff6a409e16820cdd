# Functions that make sure a service or tool the worker or its tests need
# is there: each uses what the machine has, and on a Debian machine
# installs and starts what is missing. Sourced by scripts/worker and
# scripts/test; not run on its own.
#
# Elsewhere (macOS, another Linux) nothing is installed: each function says
# what to install and stops.

apt_updated=""

# as_root runs a command as root: directly when we are root, else with sudo.
as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# apt_install installs Debian packages, or explains what to install where
# there is no apt-get.
apt_install() {
  if ! command -v apt-get >/dev/null; then
    echo "error: this machine has no apt-get, so $* cannot be installed for you." >&2
    echo "Install it yourself (on macOS: brew install ${BREW_HINT:-$*}), then run this again." >&2
    exit 1
  fi
  if [ -z "$apt_updated" ]; then
    as_root apt-get update -qq
    apt_updated=1
  fi
  echo "installing $* with apt-get" >&2
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

wait_for() { # wait_for SECONDS COMMAND...: poll a readiness check
  local n=$1; shift
  for _ in $(seq 1 "$n"); do "$@" && return 0; sleep 1; done
  "$@"
}

pg_ready() { pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; }

# ensure_postgres makes PostgreSQL answer on 127.0.0.1:5432 for the user
# postgres without a password, which is what the worker's default URL and
# the tests' use. A server it installs itself is a local development
# cluster: it trusts every role, but only from this machine.
ensure_postgres() {
  if command -v pg_isready >/dev/null && pg_ready; then return; fi
  local installed=""
  if ! command -v pg_ctlcluster >/dev/null; then
    BREW_HINT="postgresql@16 && brew services start postgresql@16" apt_install postgresql
    installed=1
  fi
  local v
  for v in $(ls /etc/postgresql); do
    if [ -n "$installed" ]; then
      # First lines win in pg_hba.conf. Every role: the tests log in with
      # roles they create.
      echo "PostgreSQL $v: trusting every role from 127.0.0.1 and ::1, without a password" \
        "(first lines of /etc/postgresql/$v/main/pg_hba.conf; a local development server)" >&2
      as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' \
        "/etc/postgresql/$v/main/pg_hba.conf"
    fi
    echo "starting PostgreSQL $v" >&2
    as_root pg_ctlcluster --skip-systemctl-redirect "$v" main start 2>/dev/null ||
      as_root pg_ctlcluster --skip-systemctl-redirect "$v" main reload || true
  done
  wait_for 60 pg_ready || { echo "error: PostgreSQL did not start on 127.0.0.1:5432" >&2; exit 1; }
}

rabbit_ready() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }

# ensure_rabbitmq makes RabbitMQ answer on 127.0.0.1:5672 (guest/guest).
# The TLS and memory-alarm tests start nodes of their own from the same
# package, which register with the epmd this broker starts.
ensure_rabbitmq() {
  if rabbit_ready; then return; fi
  command -v rabbitmq-server >/dev/null || BREW_HINT="rabbitmq && brew services start rabbitmq" apt_install rabbitmq-server
  # The package's install may have started it already.
  if ! rabbit_ready; then
    echo "starting RabbitMQ" >&2
    as_root rabbitmq-server -detached
  fi
  wait_for 60 rabbit_ready || { echo "error: RabbitMQ did not start on 127.0.0.1:5672" >&2; exit 1; }
}

redis_ready() {
  (exec 3<>/dev/tcp/127.0.0.1/6379 && printf 'PING\r\n' >&3 && read -r -t 2 reply <&3 && [[ $reply == +PONG* ]]) 2>/dev/null
}

# ensure_redis makes Redis answer on 127.0.0.1:6379 without a password, for
# the Redis lock provider's tests. A server it starts itself keeps nothing
# on disk (no snapshots, no append-only file): the tests need none.
ensure_redis() {
  if redis_ready; then return; fi
  command -v redis-server >/dev/null || BREW_HINT="redis && brew services start redis" apt_install redis-server
  # The package's install may have started it already.
  if ! redis_ready; then
    local dir="${TMPDIR:-/tmp}/worker-redis"
    mkdir -p "$dir"
    echo "starting Redis" >&2
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir "$dir" --logfile "$dir/redis.log"
  fi
  wait_for 30 redis_ready || { echo "error: Redis did not start on 127.0.0.1:6379 (see ${TMPDIR:-/tmp}/worker-redis/redis.log)" >&2; exit 1; }
}

# ensure_chromium brings Debian's chromium, which the River UI browser test
# drives at /usr/bin/chromium.
ensure_chromium() {
  [ -x /usr/bin/chromium ] || BREW_HINT="--cask chromium" apt_install chromium
}

# ensure_promtool extracts promtool from Debian's prometheus package.
# Installing the package would also start a Prometheus server on :9090,
# the worker's ops port.
ensure_promtool() {
  command -v promtool >/dev/null && return
  if ! command -v apt-get >/dev/null; then
    echo "error: promtool is missing; install Prometheus's promtool (on macOS: brew install prometheus), then run this again." >&2
    exit 1
  fi
  echo "extracting promtool from Debian's prometheus package"  >&2
  local tmp
  tmp=$(mktemp -d)
  chmod 0755 "$tmp" # apt's download user must be able to write there
  [ -n "$apt_updated" ] || { as_root apt-get update -qq; apt_updated=1; }
  (cd "$tmp" && apt-get download -qq prometheus && dpkg -x prometheus_*.deb x)
  as_root install -m 0755 "$tmp/x/usr/bin/promtool" /usr/local/bin/promtool
  rm -rf "$tmp"
}

ensure_go() {
  command -v go >/dev/null && return
  echo "error: Go is missing; install Go 1.26 or newer (https://go.dev/doc/install), then run this again." >&2
  exit 1
}
