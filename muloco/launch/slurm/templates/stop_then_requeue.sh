export MULOCO_STOP_FILE="$RUN_DIR/@{slurm_dir}/stop-$JOB_KEY"
rm -f "$MULOCO_STOP_FILE" "$MULOCO_STOP_FILE.at"  # a requeued job starts without the last request
STOPPING=0; WATCHDOG=
ask_to_stop() {  # the run writes a checkpoint where it stands (DiLoCo groups at a shared sync), exits
  [ "$STOPPING" = 1 ] && return; STOPPING=1
  echo "muloco: $1: the run checkpoints and stops, then the job requeues"
  mkdir -p "$RUN_DIR/@{slurm_dir}" && touch "$MULOCO_STOP_FILE"
  # a run still going near the limit is requeued anyway (from its newest complete checkpoint):
  # never let the job end as TIMEOUT, which SLURM does not requeue
  ( sleep @{watchdog_s}; requeue_self "the run did not stop within @{watchdog_s} s" ) & WATCHDOG=$!
}
trap 'ask_to_stop "USR1: time limit or preemption"' USR1
