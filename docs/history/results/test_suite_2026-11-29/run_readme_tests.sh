#!/bin/bash
# The README's second command, timed in two parts (set-up, tests), on a fresh clone.
cd "$1"
cmd=$(sed -n '/^python3 -m venv/p' README.md | sed -n 2p)
setup="${cmd%% && .venv/bin/python -m pytest*}"
tests=".venv/bin/python -m pytest${cmd##* .venv/bin/python -m pytest}"
echo "setup: $setup"; echo "tests: $tests"
s=$(date +%s.%N); eval "$setup" > setup.log 2>&1 || { echo setup failed; exit 1; }; m=$(date +%s.%N)
eval "$tests -p no:cacheprovider --durations=30 --junitxml=junit.xml" > tests.log 2>&1; rc=$?; e=$(date +%s.%N)
echo "rc=$rc setup_s=$(echo "$m - $s" | bc) tests_s=$(echo "$e - $m" | bc) total_s=$(echo "$e - $s" | bc)"
tail -1 tests.log
