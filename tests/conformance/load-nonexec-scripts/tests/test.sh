#!/bin/bash
# Runs the task's pytest file; per-test results in JUnit XML, the task's reward in reward.txt.
mkdir -p /logs/verifier
python3 -m pytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_outputs.py
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
