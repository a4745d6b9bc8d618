#!/usr/bin/env bash
# Install the Debian packages of the local test cluster (SLURM 22.05, munge, MariaDB),
# without starting any of their system services. Needs root; a no-op when installed.
set -euo pipefail
PKGS="slurmctld slurmd slurm-client slurmdbd munge mariadb-server"
missing=$(for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
[ -z "$missing" ] && exit 0
[ "$(id -u)" = 0 ] || { echo "tests/slurm/install.sh: needs root to install: $missing" >&2; exit 1; }
# keep the packages' init scripts from starting daemons: start.sh runs its own
policy=/usr/sbin/policy-rc.d
added=no
if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod 755 "$policy"; added=yes; fi
trap '[ "$added" = yes ] && rm -f "$policy"' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing >/dev/null
