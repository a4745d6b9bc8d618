#!/usr/bin/env bash
# Stop the local test cluster started by tests/slurm/start.sh: only the daemons it started,
# by the pid files it keeps under $SNAKETUNE_SLURM_DIR. Jobs still running are ended by
# their slurmd. Its state (database, spool) stays for the next start.
set -uo pipefail
D=${SNAKETUNE_SLURM_DIR:-/var/lib/snaketune-slurm}
. "$(dirname "$0")/pids.sh"  # running PIDFILE NAME: only a process by the daemon's name is stopped
for entry in slurmd-tupi1:slurmd slurmd-tupi2:slurmd slurmctld:slurmctld slurmdbd:slurmdbd \
             mariadb:mariadbd munge/munged:munged; do
  name=${entry%%:*} comm=${entry#*:}
  pidfile="$D/$name.pid"
  [ -s "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if running "$pidfile" "$comm"; then
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    echo "stopped $name ($pid)"
  fi
  rm -f "$pidfile"
done
