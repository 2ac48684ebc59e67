#!/bin/bash
# Shared by both steps: each step's own tests/test_step.py is copied over this folder before it runs.
mkdir -p /logs/verifier
cd /app
python3 -m pytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_step.py
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
