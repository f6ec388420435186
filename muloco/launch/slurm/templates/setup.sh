
# --- cluster setup (setup in the cluster file): a failing line stops the job ---
trap 'echo "muloco: the cluster setup failed (exit $?) at: $BASH_COMMAND; fix setup in @{cluster_file}" >&2; exit @{setup_failed}' ERR
@{setup}
trap - ERR
