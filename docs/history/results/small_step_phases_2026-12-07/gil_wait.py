"""`Parts.advance` timed in wall time and in its thread's CPU time (`time.thread_time`), inside `phases.py`: the
same PYTHONPATH and preload."""
import time, runpy, sys
import fuyou_strategy.optim.schedule as S
f = S.Parts.advance
W, C = [], []
def adv(*a, **k):
    w, c = time.perf_counter(), time.thread_time()
    try: return f(*a, **k)
    finally: W.append(time.perf_counter() - w); C.append(time.thread_time() - c)
S.Parts.advance = adv
sys.argv = ["phases.py"]
runpy.run_path(str(__import__("pathlib").Path(__file__).parent / "phases.py"))
import statistics
print(f"advance: wall {statistics.median(W[10:])*1e3:.2f} ms, its thread's CPU {statistics.median(C[10:])*1e3:.3f} ms")
