# A plain FuyouEngine loop, GPT-2 124M fp32, batch 2 x 256, the state on the SSD, 5 steps: what the run itself reports
import logging, sys, torch, transformers
from fuyou_strategy import FuyouConfig, FuyouEngine
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=256))
engine = FuyouEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
                     config=FuyouConfig(swap_dirs=["/tmp/iocpu"], host_state=0))
g = torch.Generator().manual_seed(0)
for step in range(5):
    ids = torch.randint(0, 50257, (2, 256), generator=g)
    engine.begin_micro_batch(update=True)
    model(input_ids=ids, labels=ids).loss.backward()
    engine.optimizer.step(); engine.optimizer.zero_grad(set_to_none=True)
print("io_cpu", engine.summary()["io_cpu"])
engine.close()
