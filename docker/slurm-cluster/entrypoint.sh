#!/bin/sh
# Container entry point: `slurmctld` or `slurmd <node>`. Every container runs on the host
# network, so every daemon listens on its own port (SLURMCTLD_PORT, N1_PORT, N2_PORT).
#
# The first container to start makes, under a lock, what the cluster shares in the
# `cluster` volume (/cluster): the munge key, the slurm_fiber site issuer key and its
# JWKS (keys/), the site state root (fiber/) and token spool (fiber-spool/). So any
# service can start alone (`compose start slurmctld` needs no one-shot service first).
# Then each container writes its /etc/slurm/slurm.conf from slurm.conf.in, with the
# ports, this container's view of the hardware (`slurmd -C`) and the cgroup plugins
# SLURM_CGROUP names (v2 or none; with v2 also cgroup.conf), starts its own munged,
# and execs the daemon in the foreground. /tmp is a volume all containers share, as the
# nodes of the bare-host cluster share the host's (a job's files are seen where conform
# runs). Every directory here that job users read is root's and 0755.
set -eu
role=${1:?usage: entrypoint.sh slurmctld | slurmd NODE}
umask 022
chmod 1777 /tmp
chmod 0755 /cluster

exec 9>/cluster/.setup.lock
flock -w 60 9
mkdir -p -m 0700 /cluster/munge
[ -s /cluster/munge/munge.key ] || mungekey --create --keyfile=/cluster/munge/munge.key --bits=1024
mkdir -p -m 0755 /cluster/keys /cluster/fiber /cluster/fiber-spool
if [ ! -s /cluster/keys/citest.jwks.json ]; then
  slurm-fiber keys gen --issuer citest --out /cluster/keys >/dev/null
  for key in /cluster/keys/citest-*.key; do ln -sf "$(basename "$key")" /cluster/keys/citest.key; done
  chmod 0644 /cluster/keys/citest.jwks.json
fi
flock -u 9
exec 9>&-

# slurm.conf: the ports, the hardware as this container sees it, and Slurm's cgroup
# plugins (SLURM_CGROUP, the same in every container: `cluster up --slurm-cgroup`).
case "${SLURM_CGROUP:-none}" in
  v2)
    proctrack=proctrack/cgroup taskplugin=task/cgroup
    # cgroup/v2 in the node's own cgroup2 subtree, bind-mounted at /sys/fs/cgroup by
    # `cluster up`. The host's cgroup2 has no controllers (v1 holds them), so nothing is
    # constrained: Slurm tracks and kills through the tree (cgroup.procs, cgroup.kill,
    # cgroup.freeze). No systemd: slurmd makes system.slice/<node>_slurmstepd.scope itself.
    cat > /etc/slurm/cgroup.conf <<'CONF'
CgroupPlugin=cgroup/v2
CgroupMountpoint=/sys/fs/cgroup
IgnoreSystemd=yes
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainSwapSpace=no
ConstrainDevices=yes
CONF
    ;;
  none) proctrack=proctrack/linuxproc taskplugin=task/none; rm -f /etc/slurm/cgroup.conf ;;
  *) echo "entrypoint.sh: SLURM_CGROUP=$SLURM_CGROUP: v2 or none" >&2; exit 2 ;;
esac
hardware=$(slurmd -C | head -n1 | sed 's/^NodeName=[^ ]* //; s/ *$//')
sed -e "s/@SLURMCTLD_PORT@/${SLURMCTLD_PORT:-6917}/" -e "s/@N1_PORT@/${N1_PORT:-6918}/" \
    -e "s/@N2_PORT@/${N2_PORT:-6919}/" -e "s/@HARDWARE@/$hardware/" \
    -e "s|@PROCTRACK@|$proctrack|" -e "s|@TASKPLUGIN@|$taskplugin|" \
    /etc/slurm/slurm.conf.in > /etc/slurm/slurm.conf.tmp
mv /etc/slurm/slurm.conf.tmp /etc/slurm/slurm.conf

install -o munge -g munge -m 0400 /cluster/munge/munge.key /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
chmod 0755 /run/munge
runuser -u munge -- munged
mkdir -p /var/spool/slurmctld /var/log/slurm

case "$role" in
  slurmctld) exec slurmctld -D -f /etc/slurm/slurm.conf ;;
  slurmd)
    node=${2:?slurmd needs its node name}
    mkdir -p "/var/spool/slurmd/$node"
    # Two fake GPUs: character devices with NVIDIA's major number (nothing drives them;
    # the container's device cgroup rule allows 195:*).
    mkdir -p /dev/fake-gpu
    for i in 0 1; do
      [ -c /dev/fake-gpu/nvidia$i ] || mknod -m 666 /dev/fake-gpu/nvidia$i c 195 $i
    done
    if [ "${SLURM_CGROUP:-none}" = v2 ]; then
      # As in a container with its own cgroup namespace on a cgroup v2 host: the container's
      # init and slurmd in the node's subtree (/sys/fs/cgroup), slurmd in a cgroup namespace
      # rooted there (CAP_SYS_ADMIN, given in this mode only), with cgroup2-view.c preloaded
      # (it and its slurmstepds see only the 0:: line of /proc/<pid>/cgroup).
      # system.slice is there on every systemd host; 22.05 makes only the scope below it.
      echo 1 > /sys/fs/cgroup/cgroup.procs
      echo $$ > /sys/fs/cgroup/cgroup.procs
      mkdir -p /sys/fs/cgroup/system.slice
      exec unshare --cgroup env LD_PRELOAD=/usr/local/lib/cgroup2-view.so \
        slurmd -D -f /etc/slurm/slurm.conf -N "$node"
    fi
    exec slurmd -D -f /etc/slurm/slurm.conf -N "$node" ;;
  *) echo "entrypoint.sh: unknown role $role" >&2; exit 2 ;;
esac
