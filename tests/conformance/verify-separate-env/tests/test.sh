#!/bin/bash
# Runs in the verifier's own environment; its image holds this folder as /tests.
mkdir -p /logs/verifier
python3 -m pytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
