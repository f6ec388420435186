#!/usr/bin/env bash
# Run the whole test suite the four ways that show it does not depend on machine speed:
#
#   scripts/suite_speed_matrix.sh ci         as CI does (.ci/run)
#   scripts/suite_speed_matrix.sh one-core   pinned to one core (taskset -c 0)
#   scripts/suite_speed_matrix.sh hog        next to 4 CPU hogs per core (stress-ng --cpu 4N; HOG_PER_CORE=4)
#   scripts/suite_speed_matrix.sh twice      twice in a row, nothing cleaned up in between
#   scripts/suite_speed_matrix.sh all        the four, one after the other
#
# Each run appends one line "MODE: <pytest's last line> (<seconds> s)" to
# ${MATRIX_LOG:-suite-speed-matrix.log} and keeps pytest's whole output next to it.
# stress-ng (Debian's package) is installed when missing; the hog is ended by its PID.
set -uo pipefail
cd "$(dirname "$0")/.."
log="${MATRIX_LOG:-suite-speed-matrix.log}"
pytest_cmd=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25)

need_stress_ng() {
    command -v stress-ng >/dev/null 2>&1 && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "suite_speed_matrix.sh: stress-ng is missing; install it (apt-get install stress-ng) and run again" >&2
        exit 1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends stress-ng >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends stress-ng; } \
        || { echo "suite_speed_matrix.sh: apt-get install stress-ng failed" >&2; exit 1; }
}

record() {  # $1 mode, $2 output file, $3 seconds, $4 status
    local last; last=$(grep -E "passed|failed|error" "$2" | tail -1)
    echo "$1: ${last:-no pytest summary} (exit $4, $3 s; output in $2)" | tee -a "$log"
}

run_one() {  # $1 mode, then the command
    local mode=$1; shift
    local out="${log%.log}-$mode.txt" start status
    start=$(date +%s)
    "$@" > "$out" 2>&1
    status=$?
    record "$mode" "$out" "$(( $(date +%s) - start ))" "$status"
    return "$status"
}

mode_ci() { run_one ci .ci/run; }
mode_one_core() { ./setup.sh >/dev/null && run_one one-core taskset -c 0 "${pytest_cmd[@]}"; }
mode_hog() {
    need_stress_ng
    ./setup.sh >/dev/null || return 1
    stress-ng --cpu "$(( ${HOG_PER_CORE:-4} * $(nproc) ))" --timeout 14400 --quiet &
    local hog=$!
    run_one hog "${pytest_cmd[@]}"
    local status=$?
    kill "$hog" 2>/dev/null; wait "$hog" 2>/dev/null
    return "$status"
}
mode_twice() {
    ./setup.sh >/dev/null || return 1
    run_one twice-1 "${pytest_cmd[@]}"; local a=$?
    run_one twice-2 "${pytest_cmd[@]}"; local b=$?
    [ "$a" -eq 0 ] && [ "$b" -eq 0 ]
}

case "${1:-}" in
    ci) mode_ci ;;
    one-core) mode_one_core ;;
    hog) mode_hog ;;
    twice) mode_twice ;;
    all) rc=0; for m in ci one_core hog twice; do "mode_$m" || rc=1; done; exit $rc ;;
    *) sed -n '2,13p' "$0"; exit 2 ;;
esac
