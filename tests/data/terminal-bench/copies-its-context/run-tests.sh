#!/bin/bash
# tb1's verifier: the parser reads pytest's short test summary.
echo "=========================== short test summary info ============================"
if [ "$(cat /app/answer.txt 2>/dev/null)" = "$(cat "$TEST_DIR/expected.txt")" ]; then
  echo "PASSED tests/test_outputs.py::test_answer"
else
  echo "FAILED tests/test_outputs.py::test_answer"
fi
