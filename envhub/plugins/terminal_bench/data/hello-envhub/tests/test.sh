#!/bin/bash
# Plain bash checks (no network, no pytest): per-test results as ctrf.json, the reward
# as reward.txt (1 when every check passes).
mkdir -p /logs/verifier
results=()
check() {  # name, command...
  local name=$1; shift
  if "$@" >/dev/null 2>&1; then status=passed; else status=failed; fi
  echo "$name: $status"
  results+=("{\"name\": \"$name\", \"status\": \"$status\"}")
}
check test_hello_file grep -qx 'Hello, envhub!' /app/hello.txt
check test_greet_executable test -x /app/greet.sh
check test_greet_output bash -c '[ "$(/app/greet.sh Ada)" = "Hello, Ada!" ]'
joined=$(IFS=,; echo "${results[*]}")
echo "{\"results\": {\"tests\": [$joined]}}" > /logs/verifier/ctrf.json
if grep -q '"failed"' /logs/verifier/ctrf.json; then echo 0 > /logs/verifier/reward.txt; else echo 1 > /logs/verifier/reward.txt; fi
