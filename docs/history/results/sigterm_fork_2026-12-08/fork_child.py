import os, signal, sys
from fuyou_strategy import FuyouConfig
from fuyou_strategy.storage import TensorStore
store = TensorStore(FuyouConfig(swap_dirs=[sys.argv[1]], chunk_size="8KiB", host_memory_budget="1MiB"))
ready, up = os.pipe()
pid = os.fork()
if pid == 0:  # e.g. a DataLoader worker, stopped with SIGTERM
    os.write(up, b"!")  # a signal before the child's interpreter is set up would be dropped
    signal.pause()
    os._exit(0)
os.read(ready, 1)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
print(os.WIFSIGNALED(status) and os.WTERMSIG(status), os.path.isdir(store.run_dirs[0]), flush=True)
store.close()
