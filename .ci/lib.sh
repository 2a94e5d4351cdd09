# Shared by the .ci scripts (sourced): step headers with the elapsed time, a heartbeat line while a
# step runs long, and a filter that shows a build's progress lines.
#   CI_QUIET=1 (or --quiet on .ci/test and .ci/main): step headers only, no build progress lines.
CI_T0=${CI_T0:-$(date +%s)}
export CI_T0
CI_QUIET=${CI_QUIET:-0}
export CI_QUIET

ci_elapsed() { local s=$(($(date +%s) - CI_T0)); printf '%d:%02d' $((s / 60)) $((s % 60)); }

# step NAME: prints "== [m:ss] NAME" and names the step the heartbeat reports.
step() {
  echo "== [$(ci_elapsed)] $*"
  if [ -n "${CI_STATE:-}" ]; then echo "$*" >"$CI_STATE/step"; date +%s >"$CI_STATE/since"; fi
}

# A line every CI_HEARTBEAT seconds (default 60) naming the step still running, so that a long
# step (a CUDA file compiling, a slow test) never leaves the log silent for minutes.
heartbeat_start() {
  [ -n "${CI_HEARTBEAT_PID:-}" ] && return
  CI_STATE=$(mktemp -d)
  export CI_STATE
  (
    while sleep "${CI_HEARTBEAT:-60}" </dev/null >/dev/null 2>&1; do
      [ -f "$CI_STATE/step" ] || continue
      echo "   ... [$(ci_elapsed)] still running: $(cat "$CI_STATE/step") ($(($(date +%s) - $(cat "$CI_STATE/since"))) s)"
    done
  ) &
  CI_HEARTBEAT_PID=$!
  export CI_HEARTBEAT_PID
  trap 'kill "$CI_HEARTBEAT_PID" 2>/dev/null; rm -rf "$CI_STATE"' EXIT
}

# progress LOG: copies stdin to LOG and shows ninja's "[n/N] ..." lines (and errors) as they come,
# unless quiet; on failure the caller prints the log's tail.
progress() {
  if [ "$CI_QUIET" = 1 ]; then
    cat >"$1"
  else
    tee "$1" | grep --line-buffered -E '\[[0-9]+/[0-9]+\]|error|Error|FAILED' || true
  fi
}
