# Each script is the test's child program (tests/test_signals.py's _FORK_CHILD; the second prints each stage to
# stderr); run under load (two busy loops), 15-s limit, one fresh process per run. TREE: a checkout's src.
(python3 -c "while True: pass" &) ; (python3 -c "while True: pass" &)
for i in $(seq 1 40); do
  d=$(mktemp -d); PYTHONPATH=$TREE timeout 15 .venv/bin/python fork_child.py $d; echo "rc $?"; rm -rf $d
done
pkill -f "while True: pass"
