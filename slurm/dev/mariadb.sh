#!/usr/bin/env bash
# The MariaDB server that the local clusters' slurmdbd (ACCOUNTING=1 in up.sh) keep their accounting in: one per
# machine (Debian 12's MariaDB 10.11, from `make system-deps ACCOUNTING=1`), started on first use and left running,
# with a database per cluster, named for its controller port, that down.sh drops. It listens on the loopback
# only (TCP): the Slurm 24.11 root's slurmdbd reaches it there without a socket bound into the root.
#
#   mariadb.sh start           start the server unless it answers (concurrent callers wait on a lock)
#   mariadb.sh create DB       an empty database DB that the slurmdbd user may use (an old one is dropped first)
#   mariadb.sh drop DB         remove the database
#   mariadb.sh tmpdir          the running server's folder for temporary tables (its own, under HPKIT_MARIADB_DIR)
#
#   HPKIT_MARIADB_DIR   data, socket, log and pid file (default: ${XDG_CACHE_HOME:-$HOME/.cache}/hpkit/mariadb)
#   HPKIT_MARIADB_PORT  TCP port on 127.0.0.1 (default: 13306, away from a system MariaDB's 3306)
# slurmdbd logs in as user hpkit (password hpkit) from 127.0.0.1: a development server on the loopback only.
set -euo pipefail

dir=${HPKIT_MARIADB_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hpkit/mariadb}
port=${HPKIT_MARIADB_PORT:-13306}
sock=$dir/mysqld.sock

die() { echo "mariadb: $*" >&2; exit 1; }
client() { mariadb --no-defaults --protocol=socket --socket="$sock" -u root "$@"; }
answers() { [[ -S $sock ]] && client -e 'SELECT 1' >/dev/null 2>&1; }
# Its own folder for temporary tables: a server started by a test run took that run's TMPDIR, and once the run's
# folder was removed every later cluster's slurmdbd failed to start ("Can't create/write to file .../#sql-temptable").
tmp=$dir/tmp
answers_here() { answers && [[ $(client -Nse 'SELECT @@tmpdir' 2>/dev/null) == "$tmp" ]]; }

# A server that answers with another temporary folder (started by an earlier version of this script) is stopped
# and started again. Not under the lock: such a server holds it (it inherited the lock's descriptor).
stop_other() {
  answers || return 0
  client -e 'SHUTDOWN' >/dev/null 2>&1 || true
  for _ in $(seq 1 60); do
    answers || return 0
    sleep 0.5
  done
  die "the server with another temporary folder did not stop in 30 s (pid file: $dir/mariadbd.pid)"
}

start() {
  answers_here && return 0
  for cmd in mariadbd mariadb-install-db mariadb; do
    command -v "$cmd" >/dev/null || die "$cmd not found: install Debian's mariadb-server (make system-deps ACCOUNTING=1)"
  done
  stop_other
  mkdir -p "$dir"
  exec 8>"$dir.lock"
  flock 8
  answers_here && return 0  # started by another caller while this one waited
  mkdir -p "$tmp"
  if [[ ! -d $dir/data/mysql ]]; then
    rm -rf "$dir/data.partial"
    mariadb-install-db --no-defaults --user=root --datadir="$dir/data.partial" --auth-root-authentication-method=socket \
      --skip-test-db >"$dir/install.log" 2>&1 || die "mariadb-install-db failed (see $dir/install.log)"
    mv "$dir/data.partial" "$dir/data"
  fi
  # Small buffers: a handful of test clusters' job records, on a machine that also runs their jobs.
  setsid mariadbd --no-defaults --user=root --datadir="$dir/data" --socket="$sock" --pid-file="$dir/mariadbd.pid" \
    --bind-address=127.0.0.1 --port="$port" --log-error="$dir/mariadbd.log" --tmpdir="$tmp" \
    --innodb-buffer-pool-size=32M --innodb-log-file-size=16M --max-connections=200 --skip-name-resolve \
    </dev/null >/dev/null 2>&1 8>&- &  # the lock's descriptor stays here: the server would hold the lock
  for _ in $(seq 1 120); do
    if answers; then
      client -e "CREATE USER IF NOT EXISTS 'hpkit'@'127.0.0.1' IDENTIFIED BY 'hpkit'"
      return 0
    fi
    sleep 0.5
  done
  tail -n 20 "$dir/mariadbd.log" >&2 || true
  die "the server did not answer in 60 s (log: $dir/mariadbd.log)"
}

case ${1:-} in
  start) start ;;
  create)
    db=${2:?database name}
    [[ $db =~ ^[A-Za-z0-9_]+$ ]] || die "database names are letters, digits and _, not '$db'"
    start
    client -e "DROP DATABASE IF EXISTS \`$db\`; CREATE DATABASE \`$db\`; GRANT ALL ON \`$db\`.* TO 'hpkit'@'127.0.0.1'"
    ;;
  drop)
    db=${2:?database name}
    [[ $db =~ ^[A-Za-z0-9_]+$ ]] || die "database names are letters, digits and _, not '$db'"
    if answers; then client -e "DROP DATABASE IF EXISTS \`$db\`"; fi
    ;;
  tmpdir)
    answers || die "the server does not answer"
    client -Nse 'SELECT @@tmpdir'
    ;;
  *) die "usage: mariadb.sh start | create DB | drop DB | tmpdir" ;;
esac
