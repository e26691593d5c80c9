#!/usr/bin/env bash
# Deliberately broken builds for issue 25: apply each patch to the working tree, run the
# test that must catch it, restore the files, and report "caught" / "NOT caught".
# Not part of `make test`. Run from anywhere: tests/mutants/run.sh [PATTERN]
# (PATTERN: only patches whose name contains it). Exit status: the number not caught.
#
# Patches are tiny (-U1) and applied with reduced context, so they survive small edits
# around them; one that no longer applies is reported as "stale" (regenerate it: make the
# one-line break by hand, then `git diff -U1 > tests/mutants/NAME.patch`).
set -u
cd "$(git rev-parse --show-toplevel)"
PY=${PYTHON:-python}
export PYTHONPATH=$PWD

# patch -> the test that must fail with it applied
declare -A TESTS=(
  [1_sigterm_exits_at_once]="tests/server/test_lifecycle.py::test_sigterm_drains_a_long_stream_refuses_new_connections_and_exits_0"
  [2_disconnect_not_aborted]="tests/server/test_openai_api.py::test_disconnect_while_waiting_for_a_full_response_frees_kv_cache"
  [2_stream_disconnect_not_aborted]="tests/server/test_openai_api.py::test_disconnect_mid_stream_frees_kv_cache"
  [4_batch_dependent_reduction]="tests/engine/test_engine.py::test_batching_and_preemption_do_not_change_greedy_outputs"
  [8_prefix_hits_report_queries]="tests/server/test_metrics_exact.py::test_counters_and_histograms_move_by_exactly_what_was_served"
  [8_itl_observed_twice]="tests/server/test_metrics_exact.py::test_counters_and_histograms_move_by_exactly_what_was_served"
)

not_caught=0
for patch in tests/mutants/*.patch; do
  name=$(basename "$patch" .patch)
  [[ -n "${1:-}" && "$name" != *"$1"* ]] && continue
  test=${TESTS[$name]:-}
  if [[ -z "$test" ]]; then echo "$name: no test named in run.sh"; not_caught=$((not_caught + 1)); continue; fi
  files=$(git apply --numstat "$patch" | cut -f3)
  if ! git diff --quiet -- $files; then
    echo "$name: skipped: uncommitted changes in $files would be lost"; continue
  fi
  if ! git apply -C1 "$patch"; then
    echo "$name: stale (does not apply; regenerate it)"; not_caught=$((not_caught + 1)); continue
  fi
  log=$(mktemp /tmp/mutant-"$name"-XXXX.log)
  timeout 1200 "$PY" -m pytest "$test" -q -x -p no:cacheprovider >"$log" 2>&1
  rc=$?
  git checkout -- $files  # restore, whatever happened
  if [[ $rc -eq 1 ]]; then
    echo "$name: caught by $test"
  elif [[ $rc -eq 0 ]]; then
    echo "$name: NOT caught by $test (log: $log)"; not_caught=$((not_caught + 1))
  else
    echo "$name: error (pytest exit $rc; log: $log)"; not_caught=$((not_caught + 1))
  fi
done
exit $not_caught
