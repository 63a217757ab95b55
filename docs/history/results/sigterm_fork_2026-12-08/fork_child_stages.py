import os, signal, sys, faulthandler
from fuyou_strategy import FuyouConfig
from fuyou_strategy.storage import TensorStore
store = TensorStore(FuyouConfig(swap_dirs=[sys.argv[1]], chunk_size="8KiB", host_memory_budget="1MiB"))
ready, up = os.pipe()
pid = os.fork()
if pid == 0:  # e.g. a DataLoader worker, stopped with SIGTERM
    os.write(2, b"child: forked\n")
    pass
    os.write(up, b"!")
    os.write(2, b"child: wrote\n")
    signal.pause()
    os.write(2, b"child: after pause\n")
    os._exit(0)
sys.stderr.write("parent: forked\n"); sys.stderr.flush()
os.read(ready, 1)
sys.stderr.write("parent: read\n"); sys.stderr.flush()
os.kill(pid, signal.SIGTERM)
sys.stderr.write("parent: killed\n"); sys.stderr.flush()
_, status = os.waitpid(pid, 0)
print(os.WIFSIGNALED(status) and os.WTERMSIG(status), os.path.isdir(store.run_dirs[0]), flush=True)
store.close()
