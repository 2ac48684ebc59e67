#!/bin/bash
# Terminal-Bench 1 runs this with TEST_DIR set; Harbor's mapper rewrites $TEST_DIR to /tests and appends the reward.
mkdir -p /logs/verifier
cd /app
python3 -m pytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml $TEST_DIR/test_outputs.py -rA
