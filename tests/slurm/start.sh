#!/usr/bin/env bash
# Start a real SLURM 22.05 cluster on this machine (root, no systemd), idempotently:
#   munge, a private MariaDB on 127.0.0.1:3307, slurmdbd (accounting, so sacct works),
#   slurmctld, and two slurmd on one host: tupi1 (127.0.0.11:17001) and tupi2
#   (127.0.0.12:17002), partition `tupi`, 4 fake GPUs each (device files that are
#   symlinks to /dev/null; jobs fall back to the CPU).
#
#   tests/slurm/install.sh     # once: Debian packages
#   tests/slurm/start.sh       # seconds; a second call checks and returns
#   tests/slurm/stop.sh        # ends only the daemons this script started
#
# Everything it writes lives under $SNAKETUNE_SLURM_DIR (default /var/lib/snaketune-slurm),
# except the files SLURM only reads from fixed places: /etc/slurm/{slurm,gres,slurmdbd}.conf
# (the executor plugin strips SLURM_CONF), /etc/hosts entries for tupi1/tupi2, and a stub
# `module` command (/usr/local/bin/module) so profiles/tupi's `module load` runs unchanged.
set -euo pipefail

D=${SNAKETUNE_SLURM_DIR:-/var/lib/snaketune-slurm}
HERE=$(cd "$(dirname "$0")" && pwd)
MARK="# written by snaketune tests/slurm/start.sh"
DB_PORT=3307
DB_PASS=snaketune-local-only

die() { echo "tests/slurm/start.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (it starts system daemons)"
for cmd in munged slurmctld slurmd slurmdbd sacctmgr mariadbd mariadb-install-db; do
  command -v "$cmd" >/dev/null || die "$cmd not found; run tests/slurm/install.sh first"
done

. "$HERE/pids.sh"  # running PIDFILE NAME
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2; shift 2
  for _ in $(seq $((limit * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  die "$what did not come up in ${limit}s; see $D/log"
}

# (accounting too: sacct needs slurmdbd and its MariaDB; what is down is started below)
if running "$D/slurmctld.pid" slurmctld && running "$D/slurmd-tupi1.pid" slurmd \
   && running "$D/slurmd-tupi2.pid" slurmd \
   && running "$D/mariadb.pid" mariadbd && running "$D/slurmdbd.pid" slurmdbd \
   && sinfo -h -o %T -p tupi 2>/dev/null | grep -qv -e down -e drain; then
  echo "SLURM already running (sinfo: $(sinfo -h -o '%P %D %T' | tr '\n' ' '))"
  exit 0
fi

mkdir -p "$D"/{log,ctld,spool,gpu} /etc/slurm /run/munge

# --- fake GPUs: File= must name device files; these are links to /dev/null ----------------
for i in 0 1 2 3; do ln -sfn /dev/null "$D/gpu/nvidia$i"; done

# --- host names: tupi1/tupi2 resolve to their loopback addresses (rendezvous host) -------
for entry in "127.0.0.11 tupi1" "127.0.0.12 tupi2"; do
  grep -q "^$entry\$" /etc/hosts || echo "$entry" >> /etc/hosts
done

# --- config files (refuse to overwrite a configuration we did not write) ------------------
for f in slurm.conf gres.conf slurmdbd.conf; do
  if [ -e "/etc/slurm/$f" ] && ! grep -qF "$MARK" "/etc/slurm/$f"; then
    die "/etc/slurm/$f exists and was not written by this script; not touching it"
  fi
done
cat > /etc/slurm/slurm.conf <<CONF
$MARK
ClusterName=snaketune
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$D/ctld
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
AccountingStorageTRES=gres/gpu
# keep each job's batch script in accounting, so the tests can read what was submitted
AccountingStoreFlags=job_script
JobCompType=jobcomp/none
GresTypes=gpu
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
# the node definitions below are tupi's (32 CPUs, 256 GB, 4 GPUs), not this machine's
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
MinJobAge=300
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
NodeName=tupi1 NodeAddr=127.0.0.11 NodeHostname=tupi1 Port=17001 CPUs=32 RealMemory=256000 Gres=gpu:4 State=UNKNOWN
NodeName=tupi2 NodeAddr=127.0.0.12 NodeHostname=tupi2 Port=17002 CPUs=32 RealMemory=256000 Gres=gpu:4 State=UNKNOWN
PartitionName=tupi Nodes=tupi1,tupi2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
cat > /etc/slurm/gres.conf <<CONF
$MARK
AutoDetect=off
NodeName=tupi[1-2] Name=gpu File=$D/gpu/nvidia[0-3]
CONF
cat > /etc/slurm/slurmdbd.conf <<CONF
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
PidFile=$D/slurmdbd.pid
LogFile=$D/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
CONF
chmod 600 /etc/slurm/slurmdbd.conf

# --- stub `module` (environment modules) for the profiles' module loads ------------------
if [ ! -e /usr/local/bin/module ] || grep -qF "$MARK" /usr/local/bin/module; then
  cat > /usr/local/bin/module <<CONF
#!/bin/sh
$MARK
# Stand-in for environment modules on the local test cluster: records what was asked.
echo "module (local test cluster stub): \$*" >&2
CONF
  chmod 755 /usr/local/bin/module
fi

# --- munge --------------------------------------------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
mkdir -p "$D/munge" && chown munge:munge "$D/munge"
if ! running "$D/munge/munged.pid" munged; then
  runuser -u munge -- munged --pid-file="$D/munge/munged.pid" 2>>"$D/log/munged.log"
  wait_for 10 munged test -s "$D/munge/munged.pid"
fi
wait_for 10 munge sh -c 'munge -n | unmunge'

# --- MariaDB (private instance for accounting) ---------------------------------------------
if [ ! -d "$D/mysql/mysql" ]; then
  mariadb-install-db --user=root --datadir="$D/mysql" --auth-root-authentication-method=socket \
    --skip-test-db >"$D/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed: $D/log"
fi
if ! running "$D/mariadb.pid" mariadbd; then
  mariadbd --user=root --datadir="$D/mysql" --socket="$D/mysql.sock" --port=$DB_PORT \
    --bind-address=127.0.0.1 --pid-file="$D/mariadb.pid" --log-error="$D/log/mariadb.log" \
    --innodb-buffer-pool-size=64M --skip-name-resolve >/dev/null 2>&1 &
  wait_for 30 MariaDB mariadb --socket="$D/mysql.sock" -e "select 1"
fi
mariadb --socket="$D/mysql.sock" <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
SQL

# --- slurmdbd, then the cluster and an account in it --------------------------------------
if ! running "$D/slurmdbd.pid" slurmdbd; then
  slurmdbd
  wait_for 30 slurmdbd sacctmgr -n list cluster
fi
sacctmgr -i -Q add cluster snaketune >/dev/null 2>&1 || true
sacctmgr -i -Q add account snaketune Description=tests Organization=snaketune >/dev/null 2>&1 || true
sacctmgr -i -Q add user root Account=snaketune DefaultAccount=snaketune >/dev/null 2>&1 || true

# --- slurmctld and the two slurmd ---------------------------------------------------------
if ! running "$D/slurmctld.pid" slurmctld; then
  slurmctld
  wait_for 30 slurmctld scontrol ping
fi
for node in tupi1 tupi2; do
  running "$D/slurmd-$node.pid" slurmd || slurmd -N "$node"
done
up() { [ "$(sinfo -h -p tupi -t idle,mix,alloc -o %D)" = 2 ]; }
for node in tupi1 tupi2; do scontrol update NodeName=$node State=RESUME >/dev/null 2>&1 || true; done
wait_for 30 "two idle nodes" up
echo "SLURM up: $(sinfo -h -o '%P %D %T %G' | tr '\n' ' ')"
