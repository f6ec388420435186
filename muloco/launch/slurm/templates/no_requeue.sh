finish_run() { exit "$1"; }
