"""FuyouAdamW checkpoints: exact resume, layout independence, checksums, refusals."""

import copy

import pytest
import torch

from conftest import decay_groups, tiny_causal_lm
from fuyou_strategy import FuyouAdamW
from fuyou_strategy.optim.checkpoint import CheckpointError
from test_optimizer import batches, lm_loss, small_config


def run(model, opt, steps, start=0):
    for step in range(start, start + steps):
        (lm_loss(model, batches(step, 0)) * (1.0 if step % 2 else 0.01)).backward()
        opt.step()
        opt.zero_grad()


def make(tmp_path, model, name, **cfg):
    (tmp_path / name).mkdir(exist_ok=True)
    return FuyouAdamW(decay_groups(model), lr=3e-3, max_grad_norm=0.5, config=small_config(tmp_path / name, **cfg))


@pytest.mark.parametrize("chunk_on_resume", ["12KiB", "24KiB"])
def test_resume_from_a_checkpoint_is_exact(tmp_path, chunk_on_resume):
    model = tiny_causal_lm("llama")
    straight = copy.deepcopy(model)
    opt = make(tmp_path, model, "a")
    run(model, opt, 3)
    sd = opt.state_dict(tmp_path / "ckpt")
    weights = copy.deepcopy(model.state_dict())
    opt.close()

    resumed = tiny_causal_lm("llama", seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(weights)
    opt2 = make(tmp_path, resumed, "b", chunk_size=chunk_on_resume)  # another chunk layout on SSD
    opt2.load_state_dict(sd)
    run(resumed, opt2, 3, start=3)

    opt3 = make(tmp_path, straight, "c")
    run(straight, opt3, 6)
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(resumed.parameters(), straight.parameters()):
        a, b = opt2.read_state(p), opt3.read_state(q)
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert opt2.state[next(resumed.parameters())]["step"].item() == 6
    opt2.close()
    opt3.close()


def test_corrupt_checkpoint_is_refused_and_changes_nothing(tmp_path):
    model = tiny_causal_lm("gpt2")
    opt = make(tmp_path, model, "a")
    run(model, opt, 2)
    sd = opt.state_dict(tmp_path / "ckpt")
    run(model, opt, 1, start=2)  # move on, so loading would visibly change things
    before = [p.detach().clone() for p in model.parameters()]
    state_before = opt.read_state(next(model.parameters()))
    path = tmp_path / "ckpt" / "exp_avg.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in exp_avg.bin parameter \d+; nothing was loaded"):
        opt.load_state_dict(sd)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    after = opt.read_state(next(model.parameters()))
    assert all(torch.equal(after[k], state_before[k]) for k in after)
    opt.close()


def test_state_dict_without_folder_cannot_resume_silently(tmp_path):
    model = tiny_causal_lm("gpt2")
    opt = make(tmp_path, model, "a")
    run(model, opt, 1)
    sd = opt.state_dict()
    assert sd["fuyou"]["folder"] is None and sd["param_groups"][0]["lr"] == 3e-3
    with pytest.raises(CheckpointError, match="holds no SSD state .*state_dict\\(folder\\)"):
        opt.load_state_dict(sd)
    with pytest.raises(CheckpointError, match="no optimizer.json"):
        opt.load_state_dict({"fuyou": {"folder": str(tmp_path)}, "state": {}, "param_groups": []})
    other = make(tmp_path, torch.nn.Linear(3, 3), "b")
    opt.state_dict(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="holds .* parameters, the optimizer has 2"):
        other.load_state_dict({"fuyou": {"folder": str(tmp_path / "ckpt")}, "state": {}, "param_groups": []})
    opt.close()
    other.close()


def test_zero_grad_between_backward_and_step_discards_the_update(tmp_path):
    model = tiny_causal_lm("gpt2")
    before = [p.detach().clone() for p in model.parameters()]
    opt = make(tmp_path, model, "a")
    lm_loss(model, batches(0, 0)).backward()  # updates run speculatively during backward
    with pytest.raises(RuntimeError, match="between backward and step"):
        opt.state_dict(tmp_path / "x")
    opt.zero_grad()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.step()  # nothing queued: a no-op
    assert opt.stats.commits == 0 and opt.stats.redos == 0
    opt.close()
