#!/bin/bash
# pytest comes with the image, so the verifier needs no network.
cd /app
python3 -m pytest "$TEST_DIR/test_outputs.py" -rA
