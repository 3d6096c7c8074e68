#!/bin/sh
# Records tests/homes/slurm/fixtures from this release's real daemons: run in the slurmctld
# container by `cluster record` (stdin), which copies /tmp/rec/out/ out. The same jobs as
# the 22.05 recording (tests/homes/slurm/fixtures/README.md), submitted as the job user sfalice:
#   A  1 GPU on n1, a name, an account and a comment  (prolog, epilog, show job, detail)
#   B  1 GPU on n1 (the second one)                    (its batch and step environments)
#   C  2 nodes, 2 GPUs each                             (prolog on n2, show job -d)
#   D  a job that completed;  E  a pending one cancelled, its comment posing as JobState=
# then scontrol ping and squeue --json, up and with slurmctld unreachable.
set -eu
rel=${1:?usage: record-fixtures.sh RELEASE}
R=/tmp/rec; O=$R/out
rm -rf "$R" /cluster/record
mkdir -p "$O" /cluster/record
chown sfalice "$R"
as() { runuser -u sfalice -- "$@"; }
submit() { as sbatch --parsable --chdir="$R" -o "$R/out-%j" "$@"; }
state() { squeue -h -j "$1" -o %T 2>/dev/null || true; }
wait_for() {  # wait_for FILE: up to 30 s
  i=0; while [ ! -s "$1" ]; do i=$((i+1)); [ $i -gt 300 ] && { echo "no $1" >&2; exit 1; }; sleep 0.1; done
}
wait_gone() {  # wait_gone JOB: until it left the queue's active states (30 s)
  i=0; while :; do case "$(state "$1")" in PENDING|RUNNING|CONFIGURING|COMPLETING) ;; *) return ;; esac
    i=$((i+1)); [ $i -gt 300 ] && { echo "job $1 still active" >&2; exit 1; }; sleep 0.1; done
}
keep() { grep -E '^(SLURM|CUDA_VISIBLE_DEVICES|GPU_DEVICE_ORDINAL|ROCR_VISIBLE_DEVICES|ZE_AFFINITY_MASK)' "$1" | LC_ALL=C sort > "$O/$2"; }

A=$(submit -w n1 --gres=gpu:1 -J "fiber test job" -A proj1 --comment="ready: warm 3 templates" --wrap "sleep 300")
wait_for "/cluster/record/prolog-$A-n1.env"
B=$(submit -w n1 --gres=gpu:1 -J plain --wrap 'env > batch-$SLURM_JOB_ID.tmp && mv batch-$SLURM_JOB_ID.tmp batch-$SLURM_JOB_ID.env; srun --overlap -n1 env > step-$SLURM_JOB_ID.tmp && mv step-$SLURM_JOB_ID.tmp step-$SLURM_JOB_ID.env; sleep 300')
wait_for "$R/step-$B.env"
until [ "$(state "$A")" = RUNNING ]; do sleep 0.1; done
scontrol -o show job "$A" > "$O/scontrol_show_job_${rel}_running.txt"
scontrol -d -o show job "$A" > "$O/scontrol_show_job_${rel}_running_detail.txt"
scancel "$A" "$B"; wait_gone "$A"; wait_gone "$B"
wait_for "/cluster/record/epilog-$A-n1.env"
C=$(submit -N2 --gres=gpu:2 -J two --wrap "sleep 300")
wait_for "/cluster/record/prolog-$C-n2.env"
until [ "$(state "$C")" = RUNNING ]; do sleep 0.1; done
scontrol -d -o show job "$C" > "$O/scontrol_show_job_${rel}_two_nodes_detail.txt"
D=$(submit -J done --wrap true); wait_gone "$D"
E=$(submit -N2 --gres=gpu:2 -J wrap --comment="x JobState=COMPLETED " --wrap true)
until [ "$(state "$E")" = PENDING ]; do sleep 0.1; done
scancel "$E"; wait_gone "$E"
scontrol -o show job "$D" > "$O/scontrol_show_job_${rel}_completed.txt"
scontrol -o show job "$E" > "$O/scontrol_show_job_${rel}_cancelled.txt"
scontrol -o show job 999999 > "$O/scontrol_show_job_${rel}_invalid.txt" 2>&1 || true
scontrol ping > "$O/scontrol_ping_${rel}_up.txt"
# As the Slurm home asks (control.py): 22.05's --json ignores every filter and lists all
# jobs; 24.11+ honour --jobs but list an ended job only with --states=all.
squeue --json --jobs="$A,$B,$C,$D,$E" --states=all > "$O/squeue_${rel}_running_and_done.json"
keep "/cluster/record/prolog-$A-n1.env" "env_${rel}_prolog_gpu_job.env"
keep "/cluster/record/epilog-$A-n1.env" "env_${rel}_epilog_gpu_job.env"
keep "/cluster/record/prolog-$C-n2.env" "env_${rel}_prolog_two_gpus_n2.env"
keep "$R/batch-$B.env" "env_${rel}_batch_gpu_job.env"
keep "$R/step-$B.env" "env_${rel}_step_gpu.env"
# slurmctld unreachable: a copy of slurm.conf whose SlurmctldPort nothing listens on.
sed 's/^SlurmctldPort=.*/SlurmctldPort=1/' /etc/slurm/slurm.conf > "$R/dead.conf"
rc=0; SLURM_CONF=$R/dead.conf scontrol ping > "$O/scontrol_ping_${rel}_down.txt" 2>&1 || rc=$?
echo "ping_down_rc=$rc" > "$O/rc.txt"
rc=0; SLURM_CONF=$R/dead.conf squeue --json --jobs="$C" --states=all > "$R/down.json" 2>"$R/down.err" || rc=$?
echo "squeue_down_rc=$rc" >> "$O/rc.txt"
if [ -s "$R/down.json" ]; then mv "$R/down.json" "$O/squeue_${rel}_ctld_down.json"
else mv "$R/down.err" "$O/squeue_${rel}_ctld_down_stderr.txt"; fi  # 24.11+: rc 1, no JSON
scancel "$C"; wait_gone "$C"
# The job cgroup layout, when the cluster runs Slurm's cgroup/v2 (`cluster up --slurm-cgroup
# v2`): job F on n1, as sfalice, reads its batch script's and a step's /proc/self/cgroup,
# and lists n1's cgroup tree (the node's subtree, /sys/fs/cgroup) while both run.
if scontrol show config | grep -q '^ProctrackType *= *proctrack/cgroup'; then
  cat > "$R/cgroup.sh" <<'JOB'
#!/bin/sh
o=/tmp/rec/cg-$SLURM_JOB_ID
cat /proc/self/cgroup > "$o-batch"
srun --overlap -n1 sh -c "cat /proc/self/cgroup > $o-step; cd /sys/fs/cgroup && find . -mindepth 1 -type d | sed 's,^[.]/,,' | LC_ALL=C sort > $o-tree"
env | grep -E '^SLURM_(JOB_ID|JOB_SLUID|JOB_USER|CLUSTER_NAME)=' | LC_ALL=C sort > "$o-job"
echo done > "$o-done"
JOB
  F=$(submit -w n1 -J cgroup "$R/cgroup.sh")
  wait_for "$R/cg-$F-done"; wait_gone "$F"
  for part in batch step tree; do cp "$R/cg-$F-$part" "$O/cgroup_${rel}_$part.txt"; done
  cp "$R/cg-$F-job" "$O/cgroup_${rel}_job.env"
fi
printf '{"release": "%s", "version": "%s", "jobs": {"A": %s, "B": %s, "C": %s, "D": %s, "E": %s}}\n' \
  "$rel" "$(scontrol -V | cut -d' ' -f2)" "$A" "$B" "$C" "$D" "$E" > "$O/recorded_${rel}.json"
rm -rf /cluster/record
