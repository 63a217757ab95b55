"""The systems the peer benchmark trains with, each run in its own process by ``run.py --worker``.

Every system trains the same model (built from a config with ``torch.manual_seed(0)``, or loaded
from a local folder), on the same generated tokens, with the same AdamW hyper-parameters (lr
1e-4, betas (0.9, 0.999), eps 1e-8, no weight decay, no clipping, constant learning rate), for
``warmup + steps`` optimizer steps, and reports the wall time of each step, each step's loss, its
process's peak RSS and the bytes its swap directory holds at the end.

A system whose library is missing or refuses the machine raises `Unavailable` with the reason;
the parent turns that (and any crash, timeout or memory overrun) into a row that says why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

LR, BETAS, EPS = 1e-4, (0.9, 0.999), 1e-8

# name: (layers, hidden, heads) of GPT-2's published sizes, then GPT-3's 2.7B, 6.7B and 13B; Llama uses the same
# widths and depths (benchmarks/gpu_check.py picks the largest Llama the disk allows).
# "tiny" (with a 512-token vocabulary) is for the harness's own test.
SIZES = {"tiny": (2, 64, 2), "124M": (12, 768, 12), "350M": (24, 1024, 16), "774M": (36, 1280, 20), "1.5B": (48, 1600, 25),
         "2.7B": (32, 2560, 32), "6.7B": (32, 4096, 32), "13B": (40, 5120, 40)}


def llama_ffn(hidden: int) -> int:
    """The Llama-shaped models' MLP width: 8/3 of ``hidden``, rounded up to a multiple of 256."""
    return (hidden * 8 // 3 + 255) // 256 * 256


class Unavailable(RuntimeError):
    """The system cannot run here (library missing, refused by the machine); the message says why."""


@dataclass
class Job:
    """What one worker trains: the parent's options, as the worker sees them."""
    arch: str
    size: str
    model: str | None
    dtype: str
    batch: int
    seq: int
    steps: int  # all optimizer steps, warm-up included
    swap_dir: str
    trace: str | None = None  # fuyou's systems: write a step timeline here (FuyouConfig.trace)
    device: str = "cpu"  # "cuda": the model computes on the GPU (benchmarks/gpu_check.py)
    n_params: int = 0  # set by build_model: the model's parameters (for TFLOPS)

    def build_model(self):
        """The model, identical in every process: built from config under seed 0, or read from ``model``;
        dropout off, so every system computes the same losses from the same weights."""
        import torch
        torch.manual_seed(0)
        model = self._build()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        self.n_params = sum(p.numel() for p in model.parameters())
        return model

    def _build(self):
        import torch
        if self.model is not None:
            from transformers import AutoModelForCausalLM
            return AutoModelForCausalLM.from_pretrained(self.model, local_files_only=True, dtype=torch.float32)
        from transformers import GPT2LMHeadModel, LlamaForCausalLM
        return (GPT2LMHeadModel if self.arch == "gpt2" else LlamaForCausalLM)(self.hf_config())

    def hf_config(self):
        """The model's transformers config, built from ``arch`` and ``size`` (no weights: cheap at any size)."""
        layers, hidden, heads = SIZES[self.size]
        vocab = {"gpt2": 50257, "llama": 32000}[self.arch] if self.size != "tiny" else 512
        if self.arch == "gpt2":
            from transformers import GPT2Config
            return GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                              n_positions=max(1024, self.seq), bos_token_id=None, eos_token_id=None)
        from transformers import LlamaConfig
        return LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                           intermediate_size=llama_ffn(hidden), vocab_size=vocab,
                           max_position_embeddings=max(2048, self.seq), bos_token_id=None, eos_token_id=None)

    def batches(self, vocab: int):
        """``steps`` batches of random tokens, the same in every process."""
        import torch
        g = torch.Generator().manual_seed(1234)
        return [torch.randint(0, vocab, (self.batch, self.seq), generator=g) for _ in range(self.steps)]


@dataclass
class Trace:
    """What a worker measured."""
    step_s: list[float]  # wall time of each optimizer step (forward, backward, update), in order
    losses: list[float]
    driver: str  # how the system was driven (through Lightning, the HF Trainer, its own engine)
    summary: dict | None = None  # fuyou's engine summary (plan, schedule, waits): why a step costs what it does


def _autocast(job: Job):
    import contextlib

    import torch
    return torch.autocast(job.device, dtype=torch.bfloat16) if job.dtype == "bf16" else contextlib.nullcontext()


def _sync(job: Job) -> None:
    """Wait for the GPU's queued work (a step's time must include it); nothing on the CPU."""
    if job.device == "cuda":
        import torch
        torch.cuda.synchronize()


def _loop(job: Job, model, step: Callable, driver: str) -> Trace:
    """Train with a plain loop: ``step(batch) -> loss tensor`` does forward, backward and update."""
    times, losses = [], []
    for batch in job.batches(model.config.vocab_size):
        start = time.perf_counter()
        loss = step(batch.to(job.device))
        losses.append(float(loss))  # waits for the device
        times.append(time.perf_counter() - start)
    return Trace(times, losses, driver)


def torch_adamw(job: Job) -> Trace:
    """The reference: ``torch.optim.AdamW(fused=True)``, everything in memory."""
    import torch
    model = job.build_model().to(job.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)
    return _plain_loop(job, model, opt, "plain loop")


def _plain_loop(job: Job, model, opt, driver: str, before: Callable[[], None] = lambda: None) -> Trace:
    """The reference's loop: ``before()``, forward, backward, ``opt.step()``, ``opt.zero_grad(set_to_none=True)``."""
    def step(batch):
        before()
        with _autocast(job):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return _loop(job, model, step, driver)


def _fuyou_fields(job: Job, everything_on_ssd: bool, **more) -> dict:
    """The `FuyouConfig` fields of a fuyou system: its placement, the trace, then ``more`` (a system's own fields
    and a name's ``@<field>=<value>``), which win."""
    traced = dict(trace=job.trace) if job.trace else {}
    if everything_on_ssd:
        fields = dict(swap_dirs=[job.swap_dir], activations="ssd", weights="ssd", host_state=0)
    else:
        # the default plan: the planner profiles the first steps and places activations and weights (and, with the
        # default host_memory_budget="auto" and host_state="auto", as much optimizer state in RAM as the plan leaves)
        fields = dict(swap_dirs=[job.swap_dir], activations="auto", weights="auto", planner_warmup_steps=2)
    return {**fields, **traced, **more}


def fuyou_lightning(job: Job, everything_on_ssd: bool = False, **more) -> Trace:
    """``Trainer(strategy=FuyouStrategy(...))`` on the CPU (or the GPU, ``job.device="cuda"``)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from fuyou_strategy import FuyouStrategy

    model = job.build_model()

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            # the kernel of the torch reference and of the HF Trainer's default optim (adamw_torch_fused):
            # fuyou keeps the optimizer's kernel, and the for-loop one (fused=None) is several times slower
            return torch.optim.AdamW(self.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.times, self.losses, self.start = [], [], 0.0

        def on_train_batch_start(self, *args) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))
            self.times.append(time.perf_counter() - self.start)

    recorder = Recorder()
    trainer = L.Trainer(strategy=FuyouStrategy(**_fuyou_fields(job, everything_on_ssd, **more)), 
                        accelerator="gpu" if job.device == "cuda" else "cpu", devices=1,
                        max_steps=job.steps, precision="bf16-mixed" if job.dtype == "bf16" else "32-true",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[recorder])
    trainer.fit(Module(), DataLoader(job.batches(model.config.vocab_size), batch_size=None))
    return Trace(recorder.times, recorder.losses, 'Lightning Trainer(strategy="fuyou")',
                 trainer.strategy.engine.summary())


def hf_trainer(job: Job, *, fuyou: bool = True, **more) -> Trace:
    """The Hugging Face ``Trainer`` with `FuyouCallback` (sequential batches, constant learning rate); ``more``:
    config fields besides the default plan's (a sweep's ``host_memory_budget``). ``fuyou=False``: the same Trainer
    without the callback (torch's fused AdamW through the Trainer: what the Trainer itself costs)."""
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fuyou_strategy import FuyouCallback

    model = job.build_model()
    # the Trainer would divide the summed loss by the tokens in the batch (batch x seq), not by the
    # predicted ones (batch x (seq - 1)) as the model and every other system here do
    model.accepts_loss_kwargs = False
    data = [{"input_ids": row, "labels": row} for b in job.batches(model.config.vocab_size) for row in b]

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.times, self.losses, self.start = [], [], 0.0

        def on_step_begin(self, *args, **kwargs) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs) -> None:
            _sync(job)  # the step's queued GPU work belongs to its time
            self.times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kwargs) -> None:
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    class InOrder(Trainer):  # the same batches in the same order as every other system
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    recorder = Recorder()
    with tempfile.TemporaryDirectory(prefix="fuyou-peers-hf-") as out:
        targs = TrainingArguments(output_dir=out, max_steps=job.steps, per_device_train_batch_size=job.batch,
                                  learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
                                  weight_decay=0.0, optim="adamw_torch_fused", lr_scheduler_type="constant",
                                  max_grad_norm=0.0,
                                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=job.device == "cpu",
                                  bf16=job.dtype == "bf16", dataloader_drop_last=True, disable_tqdm=True)
        callback = FuyouCallback(**_fuyou_fields(job, False, **more)) if fuyou else None
        trainer = InOrder(model=model, args=targs, train_dataset=data, callbacks=[c for c in (callback, recorder) if c])
        trainer.train()
    if callback is None:
        return Trace(recorder.times, recorder.losses, "HF Trainer")
    return Trace(recorder.times, recorder.losses, "HF Trainer + FuyouCallback", callback.summary)


def fuyou_engine(job: Job, **more) -> Trace:
    """`FuyouEngine` in the reference's plain loop, no framework: the engine's own cost against torch's step,
    apart from what an integration adds."""
    import torch

    from fuyou_strategy import FuyouConfig, FuyouEngine

    model = job.build_model().to(job.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)
    engine = FuyouEngine(model, opt, config=FuyouConfig(**_fuyou_fields(job, False, **more)))
    engine.expect_steps(job.steps)
    try:
        trace = _plain_loop(job, model, engine.optimizer, "plain loop + FuyouEngine",
                            before=lambda: engine.begin_micro_batch(update=True))
        return Trace(trace.step_s, trace.losses, trace.driver, engine.summary())
    finally:
        engine.close()


def _lightning_refusal(strategy: str) -> str | None:
    """Lightning's own error for ``Trainer(strategy=strategy)`` on this machine, or ``None`` if it accepts it."""
    import lightning as L
    try:
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
        trainer.strategy.setup_environment()
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


def _one_process_group() -> None:
    """The environment ``torch.distributed``'s env:// rendezvous reads, for a world of this process alone
    (DeepSpeed and Colossal-AI both initialise a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def _infinity_buffers(model) -> dict:
    """ZeRO-Infinity's parameter swap buffers: each must hold the largest parameter, so they are sized
    to it instead of DeepSpeed's default 1e8 elements (with ``buffer_count=64`` that default made a
    model of a few MB reach 13 GB of RSS here); their number comes from ``DS_BUFFER_COUNT`` (default 5,
    DeepSpeed's own)."""
    largest = max(p.numel() for p in model.parameters())
    return {"buffer_size": largest, "buffer_count": int(os.environ.get("DS_BUFFER_COUNT", "5"))}


def deepspeed_zero(job: Job, variant: str) -> Trace:
    """DeepSpeed ZeRO driven by ``deepspeed.initialize`` in one gloo process on the CPU.

    ``variant``: ``"offload"`` (ZeRO-2, optimizer on the CPU: ZeRO-Offload), ``"zero3-cpu"`` (ZeRO-3,
    parameters and optimizer on the CPU) or ``"infinity"`` (ZeRO-3, both on NVMe).
    """
    lightning_name = {"offload": "deepspeed_stage_2_offload", "zero3-cpu": "deepspeed_stage_3_offload",
                      "infinity": "deepspeed_stage_3_offload_nvme"}[variant]
    refusal = _lightning_refusal(lightning_name)
    try:
        import deepspeed
    except ImportError as e:
        raise Unavailable(f"deepspeed is not installed ({e}); run benchmarks/peers/install.sh") from e
    driver = "deepspeed.initialize" + (f" (Lightning {lightning_name!r} refused: {refusal})" if refusal else "")
    _one_process_group()
    model = job.build_model()
    zero: dict = {"stage": 2 if variant == "offload" else 3}
    if variant == "offload":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif variant == "zero3-cpu":
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    else:  # ZeRO-Infinity
        nvme = {"device": "nvme", "nvme_path": job.swap_dir}
        zero.update(offload_optimizer=dict(nvme), offload_param=dict(nvme, **_infinity_buffers(model)))
    config = {"train_micro_batch_size_per_gpu": job.batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                        "weight_decay": 0.0}},
              "zero_optimization": zero, "bf16": {"enabled": job.dtype == "bf16"},
              "aio": {"block_size": 1 << 20, "queue_depth": 16, "single_submit": False, "overlap_events": True},
              "wall_clock_breakdown": False, "steps_per_print": 1 << 30}
    deepspeed.init_distributed(dist_backend="nccl" if job.device == "cuda" else "gloo")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(batch):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        return loss.detach().float()
    return _loop(job, model, step, driver)


def _colossal_cpu_adam():
    """Colossal-AI's HybridAdam with its CPU Adam kernel built here (see colossal_cpu_adam.py)."""
    try:
        import colossalai.nn.optimizer.cpu_adam as cpu_adam
        from colossalai.nn.optimizer import HybridAdam
    except ImportError as e:
        raise Unavailable(f"colossalai is not installed ({e}); run benchmarks/peers/install.sh") from e
    from colossal_cpu_adam import build_without_cuda
    kernel = build_without_cuda()
    cpu_adam.CPUAdamLoader.load = lambda self: kernel
    return HybridAdam


def colossal(job: Job, variant: str) -> Trace:
    """Colossal-AI: ``"cpu"`` HybridAdam (its CPU Adam kernel) on the CPU, ``"nvme"`` HybridAdam with
    every optimizer state on NVMe (``nvme_offload_fraction=1``), ``"gemini"`` the Gemini plugin
    through its ``Booster``."""
    HybridAdam = _colossal_cpu_adam()
    model = job.build_model().to(job.device)
    nvme = dict(nvme_offload_fraction=1.0, nvme_offload_dir=job.swap_dir) if variant == "nvme" else {}
    if variant == "gemini":
        import colossalai
        from colossalai.booster import Booster
        from colossalai.booster.plugin import GeminiPlugin
        _one_process_group()
        colossalai.launch_from_torch(backend="gloo")
        booster = Booster(plugin=GeminiPlugin(placement_policy="static", offload_optim_frac=1.0,
                                              offload_param_frac=1.0))
        opt = HybridAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        model, opt, *_ = booster.boost(model, opt)
        backward, driver = (lambda loss: booster.backward(loss, opt)), "colossalai Booster(GeminiPlugin)"
    else:
        try:
            opt = HybridAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, **nvme)
        except ModuleNotFoundError as e:  # the NVMe optimizer needs tensornvme
            raise Unavailable(f"{e} (benchmarks/peers/install.sh builds it; it needs libaio-dev)") from e
        backward, driver = (lambda loss: loss.backward()), "HybridAdam in a plain loop (no Lightning strategy exists)"

    def step(batch):
        with _autocast(job):
            loss = model(input_ids=batch, labels=batch).loss
        backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach().float()
    return _loop(job, model, step, driver)


# The fuyou systems: name -> (run, its fixed config fields, what the row means); `system` also takes
# ``<name>@<field>=<value>[,<field>=<value>...]``, the same system with those `FuyouConfig` fields set.
FUYOU_SYSTEMS: dict[str, tuple[Callable[..., Trace], dict, str]] = {
    "fuyou-lightning": (fuyou_lightning, {}, "fuyou, Lightning strategy, planner's plan (activations, weights auto)"),
    "fuyou-hf": (hf_trainer, {}, "fuyou, HF Trainer + FuyouCallback, planner's plan"),
    "fuyou-engine": (fuyou_engine, {}, "fuyou, FuyouEngine in the reference's plain loop, planner's plan"),
    "fuyou-hf-bf16state": (hf_trainer, dict(state_format="bf16"),
                           "fuyou, HF Trainer + FuyouCallback, planner's plan, bf16 moments (state_format=\"bf16\")"),
    "fuyou-hf-backward": (hf_trainer, dict(optimizer_schedule="backward"),
                          "fuyou, HF Trainer + FuyouCallback, planner's plan, updates speculative during backward "
                          "(optimizer_schedule=\"backward\")"),
    "fuyou-hf-next-forward": (hf_trainer, dict(optimizer_schedule="next_forward"),
                              "fuyou, HF Trainer + FuyouCallback, planner's plan, updates exact ahead of the next "
                              "forward (optimizer_schedule=\"next_forward\")"),
    "fuyou-state-ssd": (fuyou_lightning, dict(host_state=0),
                        "fuyou, Lightning strategy, planner's plan, optimizer state all on SSD (host_state=0)"),
    "fuyou-ssd": (fuyou_lightning, dict(everything_on_ssd=True),
                  "fuyou, Lightning strategy, activations and weights on SSD"),
}


def _fuyou_system(run: Callable[..., Trace], fields: dict) -> Callable[[Job], Trace]:
    return lambda job: run(job, **fields)


# name -> (run, what the row means)
SYSTEMS: dict[str, tuple[Callable[[Job], Trace], str]] = {
    "torch": (torch_adamw, "torch.optim.AdamW(fused=True), all in memory (the reference)"),
    "torch-hf": (lambda job: hf_trainer(job, fuyou=False),
                 "torch.optim.AdamW(fused=True) through the HF Trainer, no fuyou (what the Trainer itself costs)"),
    **{name: (_fuyou_system(run, fields), what) for name, (run, fields, what) in FUYOU_SYSTEMS.items()},
    "ds-offload": (lambda job: deepspeed_zero(job, "offload"), "DeepSpeed ZeRO-2 + CPU optimizer (ZeRO-Offload)"),
    "ds-zero3-cpu": (lambda job: deepspeed_zero(job, "zero3-cpu"), "DeepSpeed ZeRO-3, params + optimizer on CPU"),
    "ds-infinity": (lambda job: deepspeed_zero(job, "infinity"), "DeepSpeed ZeRO-Infinity, params + optimizer on NVMe"),
    "colossal-cpu": (lambda job: colossal(job, "cpu"), "Colossal-AI HybridAdam, CPU optimizer"),
    "colossal-nvme": (lambda job: colossal(job, "nvme"), "Colossal-AI HybridAdam, optimizer states on NVMe"),
    "colossal-gemini": (lambda job: colossal(job, "gemini"), "Colossal-AI Gemini, params + optimizer offloaded"),
}


SWEPT = "fuyou-hf@"  # fuyou-hf@<host_memory_budget>, e.g. fuyou-hf@4GiB: a point of the host budget sweep


def _field_value(text: str) -> Any:
    """A `FuyouConfig` value as written after ``@<field>=``: a number or ``true``/``false`` as JSON reads it
    (``optimizer_threads=2``), anything else the string itself (``"backward"``, ``"64MiB"``)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def system(name: str) -> tuple[Callable[[Job], Trace], str] | None:
    """``(run, what the row means)`` of a system name (`SYSTEMS`; ``fuyou-hf@<bytes>``, a point of the host budget
    sweep; or ``<fuyou system>@<field>=<value>[,<field>=<value>...]``: that system with those `FuyouConfig`
    fields set, e.g. ``fuyou-hf@chunk_size=64MiB`` or ``fuyou-state-ssd@optimizer_schedule=backward``), else
    ``None``."""
    if name in SYSTEMS:
        return SYSTEMS[name]
    base, _, suffix = name.partition("@")
    if base not in FUYOU_SYSTEMS or not suffix:
        return None
    from fuyou_strategy.config import FuyouConfig, parse_bytes
    run, fixed, what = FUYOU_SYSTEMS[base]
    if "=" in suffix:
        pairs = [pair.split("=", 1) for pair in suffix.split(",")]
        if any(len(pair) != 2 for pair in pairs):
            return None
        fields = {k: _field_value(v) for k, v in pairs}
        if not set(fields) <= {f.name for f in dataclasses.fields(FuyouConfig)}:
            return None
        return _fuyou_system(run, {**fixed, **fields}), f"{what}, " + ", ".join(f"{k}={v!r}" for k, v in fields.items())
    if base != "fuyou-hf":
        return None
    try:
        parse_bytes(suffix, name="host_memory_budget")
    except ValueError:
        return None
    return (_fuyou_system(run, dict(host_memory_budget=suffix)),
            f"fuyou, HF Trainer + FuyouCallback, planner's plan, host_memory_budget={suffix!r} (the state in RAM: what "
            "the budget leaves)")


def run(name: str, job: Job) -> Trace:
    """Train ``job`` with system ``name``, quietly (the peers' warnings go to stderr, not the table)."""
    warnings.simplefilter("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    Path(job.swap_dir).mkdir(parents=True, exist_ok=True)
    return system(name)[0](job)
