import collections, os, runpy, sys, time
# Where the exact step's fixed cost goes: wall time per step inside a few functions of each thread.
from fuyou_strategy.optim import pipeline, schedule, gradients, state as st, updates
acc = collections.Counter()
def wrap(cls, name, key):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[key] += time.perf_counter() - t
    setattr(cls, name, g)
wrap(pipeline.ChunkPipeline, "_process_chunk", "worker: _process_chunk")
wrap(pipeline.ChunkPipeline, "_read", "worker: _read")
wrap(schedule.Exact, "finish", "main: Exact.finish")
wrap(gradients.Gradients, "resident_norms", "main: resident_norms")
wrap(st.OptimizerState, "drain", "main: state.drain")
wrap(schedule.Parts, "updated", "main: Parts.updated (wait)")
wrap(updates.Updater, "queue", "main: Updater.queue")
wrap(schedule.Parts, "advance", "main: Parts.advance")
wrap(schedule.Parts, "total_norm", "main: total_norm")
steps = int(sys.argv[2])
sys.argv = ["step_overhead.py"] + sys.argv[1:]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_overhead.py"), run_name="__main__")
for k, v in sorted(acc.items()): print(f"{k:32s} {v / steps * 1e3:7.2f} ms/step")
