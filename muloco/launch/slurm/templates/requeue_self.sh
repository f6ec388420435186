JOB_KEY="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"
JOB_KEY="${JOB_KEY:-$SLURM_JOB_ID}"
requeue_self() { echo "muloco: requeueing job $JOB_KEY ($1); it resumes from its newest checkpoint"; scontrol requeue "$JOB_KEY" || { echo "muloco: scontrol requeue $JOB_KEY failed" >&2; return 1; }; }
# a failed requeue ends the job as FAILED (so --resubmit-failed finds it), never as COMPLETED
