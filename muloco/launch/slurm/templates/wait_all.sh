wait_all() {  # every pid given, through the traps' interruptions of wait; the last failure's status
  local rc=0 pid status
  for pid in "$@"; do
    while :; do wait "$pid"; status=$?; kill -0 "$pid" 2>/dev/null || break; done
    [ "$status" -ne 0 ] && rc=$status
  done
  return $rc
}
