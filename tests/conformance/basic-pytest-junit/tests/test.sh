#!/bin/bash
# Plain pytest, the host image's own, with JUnit XML for per-test results; the reward is pytest's exit status.
mkdir -p /logs/verifier
cd /app
python3 -m pytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
