#!/bin/sh
# Container entry point: `keygen`, `slurmctld` or `slurmd <nodename>`.
# The munge key and the slurm_fiber site issuer key (site/) live in the shared volume
# /munge-key, made once by `keygen`; /etc/slurm-fiber/slurm-fiber.toml points at them.
set -eu
role=${1:?usage: entrypoint.sh keygen|slurmctld|slurmd NODE}
if [ "$role" = keygen ]; then
  [ -s /munge-key/munge.key ] || mungekey --create --keyfile=/munge-key/munge.key --bits=1024
  chmod 0400 /munge-key/munge.key
  if [ ! -s /munge-key/site/citest.jwks.json ]; then
    /opt/slurm_fiber/.venv/bin/slurm-fiber keys gen --issuer citest --out /munge-key/site
  fi
  for key in /munge-key/site/citest-*.key; do ln -sf "$(basename "$key")" /munge-key/site/citest.key; done
  exit 0
fi
install -o munge -g munge -m 0400 /munge-key/munge.key /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
runuser -u munge -- munged
mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
case "$role" in
  slurmctld) exec slurmctld -D -f "$SLURM_CONF" ;;
  slurmd)
    node=${2:?slurmd needs its node name}
    # Two fake GPUs: character devices with NVIDIA's major number (nothing drives them).
    mkdir -p /dev/fake-gpu
    for i in 0 1; do [ -c /dev/fake-gpu/nvidia$i ] || mknod -m 666 /dev/fake-gpu/nvidia$i c 195 $i; done
    exec slurmd -D -f "$SLURM_CONF" -N "$node" ;;
  *) echo "entrypoint.sh: unknown role $role" >&2; exit 2 ;;
esac
