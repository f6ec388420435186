RETRIES=@{retries}
FAILURES_FILE="$RUN_DIR/@{slurm_dir}/failures-$JOB_KEY"
requeue_or_exit() {  # $1: the run's exit status
  local failures; failures=$(cat "$FAILURES_FILE" 2>/dev/null || echo 0)
  if [ "$1" -ne 0 ] && [ "$failures" -lt "$RETRIES" ]; then
    echo $((failures + 1)) > "$FAILURES_FILE"
    requeue_self "exit $1, retry $((failures + 1))/$RETRIES" && exit 0
  fi
  exit "$1"
}
finish_run() {  # $1: the run's exit status; a run stopped with a checkpoint (@{exit_preempted}) requeues
  [ -n "${WATCHDOG:-}" ] && kill "$WATCHDOG" 2>/dev/null
  if [ "$1" -eq @{exit_preempted} ] || { [ "${STOPPING:-0}" = 1 ] && [ "$1" -ne 0 ]; }; then
    requeue_self "stopped with a checkpoint (exit $1)" && exit 0; exit 1
  fi  # a run that finished while asked to stop has nothing left to do
  requeue_or_exit "$1"
}
