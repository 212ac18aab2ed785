#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for the tests: slurmctld + slurmdbd (MariaDB, so that
# submitit's sacct works) + one slurmd per "node", each node in its own network/UTS/mount
# namespace with its own hostname and address on a private bridge. Root, Debian bookworm, no systemd.
#
#   bash tests/slurm/cluster.sh install     # apt packages (slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
#   bash tests/slurm/cluster.sh up          # start everything, wait until the nodes are idle
#   bash tests/slurm/cluster.sh down        # scancel, stop every daemon by its pidfile PID, remove namespaces
#   bash tests/slurm/cluster.sh kill-node N     # lose node N: its slurmd and its job processes SIGKILLed
#   bash tests/slurm/cluster.sh start-node N    # bring node N back (its slurmd registers; ReturnToService=2)
#   bash tests/slurm/cluster.sh user-signal on|off  # preemption sends the job's --signal (preempt_send_user_signal)
#                                                   # instead of SIGTERM (off: SLURM's default)
#
# Environment: SVLA_BASE (state folder, default ${TMPDIR:-/tmp}/slurmvla-cluster), SVLA_NODES (2),
# SVLA_CPUS (CPUs each node advertises, default 2), SVLA_NET (10.78.0), SVLA_PORT (17800),
# SVLA_GRACE (the preemption GraceTime of partition debug, default 30 s), SVLA_BRIDGE (svlabr0) and
# SVLA_NETNS (svlanode: namespaces svlanode1..N): a second cluster on the same machine needs its own
# SVLA_BASE, SVLA_NET, SVLA_PORT, SVLA_BRIDGE and SVLA_NETNS.
# Preemption as production clusters set it up: partition "urgent" (PriorityTier 10) preempts jobs of
# the default partition "debug" (PriorityTier 1) with PreemptType=preempt/partition_prio,
# PreemptMode=REQUEUE and GraceTime=SVLA_GRACE.
# Pitfalls this handles: munged's socket directory must be world-executable; clients need
# SLURM_CONF; `ip netns exec` remounts /sys and breaks slurmd (nsenter is used); node names resolve
# through a hosts file bind-mounted inside the node namespaces only; cred_expire and the scheduler
# intervals are short so a requeued job runs again within seconds, and a lost node is declared down
# after SlurmdTimeout=15 s.
set -euo pipefail
CMD=${1:-}
BASE=${SVLA_BASE:-${TMPDIR:-/tmp}/slurmvla-cluster}
NODES=${SVLA_NODES:-2}
CPUS=${SVLA_CPUS:-2}
NET=${SVLA_NET:-10.78.0}
PORT=${SVLA_PORT:-17800}
GRACE=${SVLA_GRACE:-30}
BR=${SVLA_BRIDGE:-svlabr0}
NS=${SVLA_NETNS:-svlanode}
CONF=$BASE/etc/slurm.conf
LOG=$BASE/log
MSOCK=$BASE/munge-run/munge.sock
CTL=$NET.1
# Who owns the bridge and the node namespaces: the state folder of the cluster that made them. Two
# clusters with the same names would share node addresses with different munge keys (a launch on a node
# then fails with "Zero Bytes were transmitted or received"), or one's down would remove the other's
# network: up refuses while the owner is alive, and down removes only what its own cluster made.
OWNER=/run/slurmvla-cluster-$BR.owner
HOST=$(hostname -s)

say() { echo "cluster: $*" >&2; }
alive() { [ -e "/proc/$1" ] && ! grep -q ') Z ' "/proc/$1/stat" 2>/dev/null; }
wait_port() {  # host port seconds
  local i
  for ((i = 0; i < $3 * 10; i++)); do (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null && return 0; sleep 0.1; done
  return 1
}
stop_pid() {
  local f=$1 pid i
  [ -s "$f" ] || return 0
  pid=$(cat "$f")
  if alive "$pid"; then
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do alive "$pid" || break; sleep 0.1; done
    alive "$pid" && kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

install() {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge slurmdbd mariadb-server iproute2 >/dev/null
}

write_conf() {
  mkdir -p "$BASE/etc" "$LOG" "$BASE/state" "$BASE/munge-key" "$BASE/munge-run"
  chmod 700 "$BASE/munge-key"; chmod 755 "$BASE/munge-run"
  {
    printf '127.0.0.1 localhost\n%s %s\n' "$CTL" "$HOST"
    for ((i = 1; i <= NODES; i++)); do printf '%s.%d node%d\n' "$NET" $((10 + i)) "$i"; done
  } > "$BASE/etc/hosts"
  cat > "$CONF" <<CONF
ClusterName=svla
SlurmctldHost=$HOST($CTL)
SlurmctldPort=$((PORT + 17))
SlurmdPort=$((PORT + 18))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MSOCK,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$LOG/slurmctld.pid
SlurmdPidFile=$LOG/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
#SlurmctldParameters=preempt_send_user_signal
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
InactiveLimit=0
MinJobAge=300
KillWait=5
SlurmdTimeout=15
Waittime=0
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTL
AccountingStoragePort=$((PORT + 19))
AccountingStoragePass=$MSOCK
CONF
  for ((i = 1; i <= NODES; i++)); do
    echo "NodeName=node$i NodeAddr=$NET.$((10 + i)) CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN" >> "$CONF"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE" >> "$CONF"
  echo "PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF" >> "$CONF"
  cat > "$BASE/etc/slurmdbd.conf" <<DBD
AuthType=auth/munge
AuthInfo=socket=$MSOCK
DbdHost=$HOST
DbdAddr=$CTL
DbdPort=$((PORT + 19))
SlurmUser=root
PidFile=$LOG/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT + 6))
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
DBD
  chmod 600 "$BASE/etc/slurmdbd.conf"
}

start_node() {  # slurmd for node $1, in that node's namespaces
  mkdir -p "$BASE/spool/node$1"
  nsenter --net="/run/netns/$NS$1" unshare --uts --mount --propagation private \
    sh -c "hostname node$1 && mount --bind '$BASE/etc/hosts' /etc/hosts && exec slurmd -f '$CONF' -N node$1"
}

kill_node() {  # a node lost: its slurmd and every process on it (the job's tasks) killed at once, by PID
  local p
  for p in $(ip netns pids "$NS$1" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
  rm -f "$LOG/slurmd-node$1.pid"
}

up() {
  local tool
  for tool in slurmctld slurmd slurmdbd munged mariadbd ip nsenter; do
    command -v "$tool" > /dev/null || { install; break; }
  done
  [ -s "$LOG/slurmctld.pid" ] && alive "$(cat "$LOG/slurmctld.pid")" && { say "already up"; return 0; }
  if [ -s "$OWNER" ] && [ "$(cat "$OWNER")" != "$BASE" ]; then
    local other
    other=$(cat "$OWNER")
    if [ -s "$other/log/slurmctld.pid" ] && alive "$(cat "$other/log/slurmctld.pid")"; then
      say "another cluster ($other) is up with bridge $BR and namespaces $NS*: bring it down (SVLA_BASE=$other $0 down) or give this one its own SVLA_BRIDGE, SVLA_NETNS, SVLA_NET and SVLA_PORT"
      exit 1
    fi
    say "cleaning up after a cluster that did not come down ($other)"
    SVLA_BASE=$other bash "$0" down || true
  fi
  if [ ! -s "$OWNER" ] && ip link show "$BR" > /dev/null 2>&1; then
    say "removing bridge $BR and namespaces $NS* that no cluster owns (left by an older cluster.sh)"
    for ((i = 1; i <= NODES; i++)); do
      for p in $(ip netns pids "$NS$i" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
      ip netns del "$NS$i" 2>/dev/null || true
    done
    ip link del "$BR" 2>/dev/null || true
  fi
  write_conf
  [ -s "$BASE/munge-key/munge.key" ] || { dd if=/dev/urandom of="$BASE/munge-key/munge.key" bs=128 count=1 status=none; chmod 400 "$BASE/munge-key/munge.key"; }
  munged --key-file="$BASE/munge-key/munge.key" --socket="$MSOCK" --pid-file="$BASE/munge-run/munged.pid" \
         --log-file="$LOG/munged.log" --seed-file="$BASE/munge-key/seed"
  echo "$BASE" > "$OWNER"
  ip link add "$BR" type bridge; ip addr add "$CTL/24" dev "$BR"; ip link set "$BR" up
  for ((i = 1; i <= NODES; i++)); do
    ip netns add "$NS$i"
    ip link add "$NS$i-h" type veth peer name eth0 netns "$NS$i"
    ip link set "$NS$i-h" master "$BR" up
    ip -n "$NS$i" addr add "$NET.$((10 + i))/24" dev eth0
    ip -n "$NS$i" link set eth0 up; ip -n "$NS$i" link set lo up
  done
  local db=$BASE/db
  mkdir -p "$db"
  [ -d "$db/data/mysql" ] || mariadb-install-db --user=root --datadir="$db/data" --auth-root-authentication-method=normal \
      --skip-test-db > "$LOG/mariadb-install.log" 2>&1
  (mariadbd --user=root --datadir="$db/data" --socket="$db/mysqld.sock" --port=$((PORT + 6)) --bind-address=127.0.0.1 \
      --pid-file="$db/mariadbd.pid" --log-error="$LOG/mariadbd.err" --skip-name-resolve --innodb-buffer-pool-size=32M \
      < /dev/null > /dev/null 2>&1 &)
  wait_port 127.0.0.1 $((PORT + 6)) 60 || { say "mariadb did not start"; exit 1; }
  mariadb --socket="$db/mysqld.sock" -uroot -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
  SLURM_CONF=$CONF slurmdbd
  wait_port "$CTL" $((PORT + 19)) 60 || { say "slurmdbd did not start"; exit 1; }
  export SLURM_CONF=$CONF
  sacctmgr -i -Q add cluster svla > /dev/null 2>&1 || true
  sacctmgr -i -Q add account tests > /dev/null 2>&1 || true
  sacctmgr -i -Q add user root account=tests > /dev/null 2>&1 || true
  slurmctld -f "$CONF"
  wait_port "$CTL" $((PORT + 17)) 30 || { say "slurmctld did not start"; exit 1; }
  for ((i = 1; i <= NODES; i++)); do start_node "$i"; done
  for ((i = 0; i < 240; i++)); do
    [ "$(sinfo -h -o '%T %D' 2>/dev/null | tr '\n' ' ')" = "idle $NODES " ] && { say "up: $NODES idle nodes"; return 0; }
    sleep 0.25
  done
  sinfo >&2 || true
  say "nodes did not become idle (see $LOG)"
  exit 1
}

down() {
  export SLURM_CONF=$CONF
  if [ -s "$LOG/slurmctld.pid" ] && alive "$(cat "$LOG/slurmctld.pid")"; then
    scancel --quiet --user=root 2>/dev/null || true
    for ((i = 0; i < 40; i++)); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.25; done
  fi
  for ((i = 1; i <= NODES; i++)); do stop_pid "$LOG/slurmd-node$i.pid"; done
  local owned=0
  [ -s "$OWNER" ] && [ "$(cat "$OWNER")" = "$BASE" ] && owned=1
  # Job processes still inside this cluster's node namespaces were started by it: end them by PID.
  for ((i = 1; i <= NODES; i++)); do
    [ "$owned" = 1 ] && [ -e "/run/netns/$NS$i" ] || continue
    for p in $(ip netns pids "$NS$i" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
  done
  stop_pid "$LOG/slurmctld.pid"; stop_pid "$LOG/slurmdbd.pid"
  stop_pid "$BASE/db/mariadbd.pid"; stop_pid "$BASE/munge-run/munged.pid"
  if [ "$owned" = 1 ]; then
    for ((i = 1; i <= NODES; i++)); do ip netns del "$NS$i" 2>/dev/null || true; done
    ip link del "$BR" 2>/dev/null || true
    rm -f "$OWNER"
  fi
  rm -rf "$BASE/state" "$BASE/spool"
  say "down"
}

case "$CMD" in
  install) install ;;
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  kill-node) kill_node "${2:?node number}" ;;
  user-signal)
    case "${2:-}" in
      on) sed -i 's/^#*SlurmctldParameters=preempt_send_user_signal/SlurmctldParameters=preempt_send_user_signal/' "$CONF" ;;
      off) sed -i 's/^#*SlurmctldParameters=preempt_send_user_signal/#SlurmctldParameters=preempt_send_user_signal/' "$CONF" ;;
      *) echo "usage: $0 user-signal on|off" >&2; exit 2 ;;
    esac
    SLURM_CONF=$CONF scontrol reconfigure ;;
  start-node) export SLURM_CONF=$CONF; start_node "${2:?node number}" ;;
  *) echo "usage: $0 install|up|down|env|kill-node N|start-node N|user-signal on|off" >&2; exit 2 ;;
esac
