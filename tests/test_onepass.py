"""The one-pass update (`optim.onepass`, ``FuyouConfig.update_kernel``): torch's fused AdamW bits from one pass over
a chunk's memory, in place and out of place, every gradient and weight dtype; the unfilled lend of the shadow slot
it reads the active chunk through; the choice and its fallbacks; and the gradient norm's upcast."""

import contextlib
import copy
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import decay_groups, tiny_causal_lm
from fuyou_strategy import FuyouAdamW, FuyouConfig, FuyouEngine
from fuyou_strategy.config import ConfigError
from fuyou_strategy.optim import onepass
from fuyou_strategy.optim.gradients import grad_norm
from test_schedule import MAX_NORM, STEPS, config, reference, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def one_pass():
    one, why = onepass.load()
    if one is None:
        pytest.skip(f"no one-pass update on this machine: {why}")
    return one


def torch_update(master, exp_avg, exp_avg_sq, grad, *, step, inv_scale, coef, **hyper):
    """fuyou's update with torch's kernel (`state.OptimizerState.update_job`'s other branch), in place."""
    g = grad.to(torch.float32)
    if inv_scale is not None:
        g = g * inv_scale
    if coef is not None:
        g = g * coef
    torch._fused_adamw_([master], [g], [exp_avg], [exp_avg_sq], [], [step + 1], amsgrad=False, maximize=False,
                        **hyper)


def test_the_one_pass_gives_torchs_fused_kernel_bits_over_many_chunks_and_values():
    """300 chunks: ragged lengths, gradients in every dtype and from tiny to large, every weight dtype, in place and
    out of place, outputs aligned (streamed stores) and not, with and without unscaling, clipping and decay."""
    one = one_pass()
    gen = torch.Generator().manual_seed(0)
    for t in range(300):
        n = 1 + int(torch.randint(0, 20 * one.block, (1,), generator=gen))
        size = 10.0 ** float(torch.empty(()).uniform_(-8, 2, generator=gen))
        shift = t % 3 == 2  # outputs one element off a vector's alignment: ordinary stores
        state = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * size * 0.1,
                 torch.rand(n, generator=gen) * size * size]
        grad = (torch.randn(n, generator=gen) * size).to(DTYPES[t % 3])
        hyper = dict(lr=(1e-3, 3e-4, 1e-2, 0.1)[t % 4], beta1=(0.9, 0.5, 0.3, 0.95, 0.0)[t % 5],
                     beta2=(0.999, 0.95, 0.9)[t % 3], weight_decay=(0.01, 0.0, 0.1, 1.0)[t % 4],
                     eps=(1e-8, 1e-6, 1e-3)[t % 3])
        step = torch.tensor(float(t % 9))
        inv_scale = torch.tensor(2.0 ** -(t % 16)) if t % 2 else None
        coef = torch.tensor(float(torch.rand((), generator=gen)), dtype=torch.float32) if t % 3 == 1 else None
        want = [s.clone() for s in state]
        torch_update(*want, grad, step=step, inv_scale=inv_scale, coef=coef, **hyper)
        weight = torch.empty(n + shift, dtype=DTYPES[(t // 3) % 3])[shift:]
        if t % 4 == 0:  # in place, the weight where the master was read from
            got = [s.clone() for s in state]
            weight = None
            one.update(*got, grad, *got, weight, step=step, inv_scale=inv_scale, coef=coef, **hyper)
        else:
            got = [torch.empty(n + shift)[shift:] for _ in range(3)]
            one.update(*state, grad, *got, weight, step=step, inv_scale=inv_scale, coef=coef, **hyper)
        for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), got, want):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (t, name, n, grad.dtype)
        if weight is not None:
            assert torch.equal(weight, want[0].to(weight.dtype)), (t, weight.dtype)


def test_the_weight_may_be_the_master_it_reads():
    """A resident fp32 parameter holding its master (the state on the SSD): read from and written to in the pass."""
    one = one_pass()
    n = 5 * one.block + 3
    param, exp_avg, exp_avg_sq, grad = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n)
    want = [param.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
    torch_update(*want, grad, step=torch.tensor(3.0), inv_scale=None, coef=None, **hyper)
    master = torch.empty(n)
    one.update(param, exp_avg, exp_avg_sq, grad, master, exp_avg, exp_avg_sq, param, step=torch.tensor(3.0),
               inv_scale=None, coef=None, **hyper)
    assert torch.equal(master, want[0]) and torch.equal(param, want[0]) and torch.equal(exp_avg_sq, want[2])


def test_the_chunk_form_gives_the_same_bits_from_the_stores_layout():
    """`OnePass.update_chunk` on a chunk as the store holds it (master, exp_avg, exp_avg_sq one after the other, the
    views made in C++): in place, out of place from a source chunk, with the master read from a parameter, with and
    without a weight, on lengths with and without a ragged end; torch's fused kernel's bits each time."""
    one = one_pass()
    gen = torch.Generator().manual_seed(5)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
    for t, n in enumerate((one.block, 7 * one.block + 5, 1, 3 * one.block - 1, 64 * one.block)):
        master, exp_avg, exp_avg_sq = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2, \
            torch.rand(n, generator=gen) * 1e-4
        grad = (torch.randn(n, generator=gen) * 1e-2).to(DTYPES[t % 3])
        step, inv_scale = torch.tensor(float(t)), torch.tensor(2.0 ** -t) if t % 2 else None
        coef = torch.tensor(0.25) if t % 3 == 2 else None
        want = [master.clone(), exp_avg.clone(), exp_avg_sq.clone()]
        torch_update(*want, grad, step=step, inv_scale=inv_scale, coef=coef, **hyper)
        kw = dict(n=n, step=step, count=onepass.step_count(step), inv_scale=inv_scale, coef=coef, **hyper)
        chunk = torch.cat([master, exp_avg, exp_avg_sq, torch.full((7,), 5.0)])  # padded, as a page-rounded chunk
        weight = torch.empty(n, dtype=torch.bfloat16)
        one.update_chunk(chunk, None, None, grad, weight, **kw)  # in place
        assert torch.equal(chunk[: 3 * n].view(torch.int32), torch.cat(want).view(torch.int32)), (t, "in place")
        assert torch.equal(weight, want[0].to(torch.bfloat16)) and torch.equal(chunk[3 * n :], torch.full((7,), 5.0))
        source, out = torch.cat([master, exp_avg, exp_avg_sq]), torch.empty(3 * n)
        one.update_chunk(out, source, None, grad, None, **kw)  # into the shadow slot, from the active one
        assert torch.equal(out.view(torch.int32), torch.cat(want).view(torch.int32)), (t, "out of place")
        assert torch.equal(source, torch.cat([master, exp_avg, exp_avg_sq]))  # read, never written
        param, source[:n] = master.clone(), float("nan")  # the parameter holds the master: the chunk's is not read
        out = torch.empty(3 * n)
        one.update_chunk(out, source, param, grad, param, **kw)
        assert torch.equal(out.view(torch.int32), torch.cat(want).view(torch.int32)), (t, "from the parameter")
        assert torch.equal(param, want[0])
    with pytest.raises(RuntimeError, match="out must be a contiguous CPU tensor of at least"):
        one.update_chunk(torch.empty(5), None, None, torch.zeros(2), None, **dict(kw, n=2))


@pytest.mark.parametrize("factors", [(None, None), (2.0 ** -7, 0.375)])
def test_the_list_form_gives_each_chunks_bits_in_one_call(factors):
    """`OnePass.update_chunks` (a grouped job's run of parameters): chunks of different lengths (ragged ends among
    them), step counts and gradient dtypes, some in place and some from a source chunk, each new weight into its own
    tensor, in one call; each chunk gets torch's fused kernel's bits, as alone."""
    one = one_pass()
    gen = torch.Generator().manual_seed(11)
    hyper = dict(lr=3e-3, beta1=0.9, beta2=0.95, weight_decay=0.01, eps=1e-8)
    inv_scale, coef = (None if f is None else torch.tensor(f) for f in factors)
    lengths = (one.block, 7 * one.block + 5, 1, 64 * one.block, 3 * one.block - 1)
    outs, sources, grads, weights, steps, wants, kept = [], [], [], [], [], [], []
    for t, n in enumerate(lengths):
        state = torch.cat([torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2,
                           torch.rand(n, generator=gen) * 1e-4])
        grad = (torch.randn(n, generator=gen) * 1e-2).to(DTYPES[t % 3])
        step = torch.tensor(float(t + 2 * (t % 2)))  # not all the same
        want = [x.clone() for x in state.split(n)]
        torch_update(*want, grad, step=step, inv_scale=inv_scale, coef=coef, **hyper)
        in_place = t % 2 == 0
        outs.append(state if in_place else torch.empty(3 * n))
        sources.append(None if in_place else state)
        kept.append(state.clone())
        grads.append(grad)
        weights.append(torch.empty(n, dtype=(torch.float32, torch.bfloat16)[t % 2]))
        steps.append(step)
        wants.append(want)
    one.update_chunks(outs, sources, grads, weights, list(lengths),
                      counts=[onepass.step_count(s) for s in steps], inv_scale=inv_scale, coef=coef, **hyper)
    for t, (out, want, weight, source) in enumerate(zip(outs, wants, weights, sources)):
        assert torch.equal(out.view(torch.int32), torch.cat(want).view(torch.int32)), t
        assert torch.equal(weight, want[0].to(weight.dtype)), t
        if source is not None:
            assert torch.equal(source, kept[t]), (t, "a source is read, never written")
    with pytest.raises(RuntimeError, match="must be lists of one length"):
        one.update_chunks(outs[:2], sources[:1], grads[:2], weights[:2], [1, 1], counts=[1.0, 1.0],
                          inv_scale=None, coef=None, **hyper)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_master_updated_in_place_in_its_parameter_gets_torchs_bits_and_leaves_the_chunks_master(threads):
    """`OnePass.update_chunks`' ``masters_in_place`` (an fp32 parameter that is its own master, state in RAM): the
    master is read from the parameter and the new one written back there only (torch's kernel's bits, a ragged end's
    too), the moments into the chunk, whose master keeps its old bytes; beside chunks updated as before in the same
    call, and a parameter given whole (shaped) as a one-chunk parameter is."""
    one = one_pass()
    gen = torch.Generator().manual_seed(17)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
    lengths = (one.block, 7 * one.block + 5, 1, one.module.grain_blocks() * one.block + 3, 12)
    outs, masters, grads, weights, owns, counts, wants, olds = [], [], [], [], [], [], [], []
    for t, n in enumerate(lengths):
        state = torch.cat([torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2,
                           torch.rand(n, generator=gen) * 1e-4])
        grad = (torch.randn(n, generator=gen) * 1e-2).to(DTYPES[t % 3])
        step = torch.tensor(float(1 + t))
        want = [x.clone() for x in state.split(n)]
        torch_update(*want, grad, step=step, inv_scale=None, coef=None, **hyper)
        own = t != 2
        param = state[:n].clone().view(3, 4) if n == 12 else state[:n].clone()  # shaped: given whole
        if own:
            state[:n] = float("nan")  # older than the parameter: never read
        olds.append(state[:n].clone())
        outs.append(state)
        masters.append(param if own else None)
        weights.append(None if own else param)
        owns.append(own)
        grads.append(grad)
        counts.append(onepass.step_count(step))
        wants.append(want)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one.update_chunks(outs, [None] * len(outs), grads, weights, list(lengths), counts=counts, inv_scale=None,
                          coef=None, master_ins=masters, masters_in_place=owns, **hyper)
    finally:
        torch.set_num_threads(before)
    for t, (n, out, want, own) in enumerate(zip(lengths, outs, wants, owns)):
        param = (masters[t] if own else weights[t]).reshape(-1)
        assert torch.equal(param.view(torch.int32), want[0].view(torch.int32)), (t, "the parameter's new master")
        assert torch.equal(out[n:].view(torch.int32), torch.cat(want[1:]).view(torch.int32)), (t, "the moments")
        if own:
            assert torch.equal(out[:n].view(torch.int32), olds[t].view(torch.int32)), (t, "the chunk's master left")
        else:
            assert torch.equal(out[:n].view(torch.int32), want[0].view(torch.int32)), (t, "the chunk's master")
    n = one.block
    with pytest.raises(RuntimeError, match="a master updated in place needs its master_in and no weight"):
        one.update_chunks([torch.zeros(3 * n)], [None], [torch.zeros(n)], [torch.zeros(n)], [n], counts=[1.0],
                          inv_scale=None, coef=None, master_ins=[torch.zeros(n)], masters_in_place=[True], **hyper)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_run_of_small_chunks_is_shared_among_the_threads_each_chunk_updated_once(threads, monkeypatch):
    """`OnePass.update_chunks` over a run of many small chunks (each one thread's in its own pass, so shared out among
    the threads a chunk at a time) with large ones among them (each shared by its own pass): every chunk gets torch's
    fused kernel's bits, as alone. A chunk skipped, updated twice, or updated by two threads at once would not. The
    compiled pass does every whole block: torch's kernel takes only the ragged ends."""
    one = one_pass()
    tails = []  # (elements the pass did, the chunk's length) of each chunk torch's kernel finished
    real_tail = one._chunk_tail
    monkeypatch.setattr(one, "_chunk_tail", lambda done, *a, **k: tails.append((done, a[5])) or real_tail(done, *a, **k))
    gen = torch.Generator().manual_seed(13)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
    big = one.module.grain_blocks() * one.block + 3  # shared by its own pass (and a ragged end)
    lengths = [big if t in (5, 40) else one.block * (1 + t % 9) + (t % 4) for t in range(64)]
    outs, grads, weights, counts, wants = [], [], [], [], []
    for t, n in enumerate(lengths):
        state = torch.cat([torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2,
                           torch.rand(n, generator=gen) * 1e-4])
        grad = (torch.randn(n, generator=gen) * 1e-2).to(DTYPES[t % 3])
        step = torch.tensor(float(1 + t % 5))
        want = [x.clone() for x in state.split(n)]
        torch_update(*want, grad, step=step, inv_scale=None, coef=None, **hyper)
        outs.append(state)
        grads.append(grad)
        weights.append(torch.empty(n))
        counts.append(onepass.step_count(step))
        wants.append(want)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one.update_chunks(outs, [None] * len(outs), grads, weights, lengths, counts=counts, inv_scale=None, coef=None,
                          **hyper)
    finally:
        torch.set_num_threads(before)
    wrong = [t for t, (out, want, weight) in enumerate(zip(outs, wants, weights))
             if not (torch.equal(out.view(torch.int32), torch.cat(want).view(torch.int32))
                     and torch.equal(weight, want[0]))]
    assert not wrong, wrong
    assert sorted(tails) == sorted((n - n % one.block, n) for n in lengths if n % one.block)


def test_queued_gradients_norms_are_taken_together_with_torchs_bits():
    """`PendingNorms`: the first update's `take` takes its gradient's norm with every other kept one the kernel reads,
    whose bytes are in place, under the same unscale factor: one call of the kernel, each norm `grad_norm`'s torch
    bits; the others' takes then compute nothing. A gradient still landing, one under another factor, one the
    kernel does not read and one a queued job still adds to (not ``final``) are left to their own take."""
    from types import SimpleNamespace

    from fuyou_strategy.optim.gradients import Grad, PendingNorms

    one = one_pass()
    if one.norm_layout is None:
        pytest.skip("torch's norm order here is none the kernel knows: the norms are torch's own")
    calls = []

    class Counted:  # the kernel, counting its norm calls
        def reads(self, g):
            return one.reads(g)

        def norms(self, grads, inv_scale):
            calls.append(len(grads))
            return one.norms(grads, inv_scale)

    class Landing:  # a device copy still in flight until waited for
        waited = False

        def landed(self):
            return False

        def wait(self):
            self.waited = True

    gen = torch.Generator().manual_seed(3)
    inv = torch.tensor(2.0 ** -7)
    sizes = (1000, 4097, 33, 20000, 77, 5000, 300, 999)
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.float32, torch.float64, torch.float32,
              torch.bfloat16)
    grads = [(torch.randn(n, generator=gen) * 10.0).to(d) for n, d in zip(sizes, dtypes)]
    landing = Landing()
    got, pending = {}, PendingNorms()
    for i, g in enumerate(grads):
        grad = Grad(SimpleNamespace(param=torch.nn.Parameter(torch.empty(g.shape, dtype=g.dtype))), g,
                    landing=landing if i == 4 else None, final=i != 7)
        pending.keep(i, grad, torch.tensor(2.0 ** -3) if i == 6 else inv, lambda v, i=i: got.__setitem__(i, v))
    pending.take(0, Counted())
    assert calls == [4] and sorted(got) == [0, 1, 2, 3]  # not the landing one, the float64 one, the other factor
    for i in range(1, 8):
        pending.take(i, Counted())
    assert calls == [4, 1, 1, 1] and sorted(got) == list(range(8)) and landing.waited  # 4, 6, 7 alone; 5 torch's
    for i, g in enumerate(grads):
        want = grad_norm(g, torch.tensor(2.0 ** -3) if i == 6 else inv)
        assert torch.equal(got[i].view(torch.int32), want.view(torch.int32)), (i, g.dtype)


def keep_gradients(pending, gen, sizes, dtypes, inv):
    """Gradients kept in ``pending`` (`PendingNorms.keep`) under the unscale factor ``inv``; returns them and where
    each one's norm is recorded (index -> norm)."""
    from types import SimpleNamespace

    from fuyou_strategy.optim.gradients import Grad

    grads = [(torch.randn(n, generator=gen) * 10.0).to(d) for n, d in zip(sizes, dtypes)]
    got = {}
    for i, g in enumerate(grads):
        grad = Grad(SimpleNamespace(param=torch.nn.Parameter(torch.empty(g.shape, dtype=g.dtype))), g)
        pending.keep(i, grad, inv, lambda v, i=i: got.__setitem__(i, v))
    return grads, got


def chunks_and_reference(gen, lengths, inv, hyper):
    """A state chunk of each length as the store holds it (master, ``exp_avg``, ``exp_avg_sq``), its step, bf16
    weight and gradient (the dtypes in turn), and torch's update of a copy (`torch_update`) to compare with: returns
    the chunks, the references (with each step), the weights, the step counts (`onepass.step_count`) and the
    gradients."""
    outs, wants, weights, counts = [], [], [], []
    for t, n in enumerate(lengths):
        state = torch.cat([torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2,
                           torch.rand(n, generator=gen) * 1e-4])
        step = torch.tensor(float(1 + t))
        want = [x.clone() for x in state.split(n)]
        outs.append(state)
        wants.append((want, step))
        weights.append(torch.empty(n, dtype=torch.bfloat16))
        counts.append(onepass.step_count(step))
    chunk_grads = [(torch.randn(n, generator=gen) * 1e-2).to(DTYPES[t % 3]) for t, n in enumerate(lengths)]
    for (want, step), g in zip(wants, chunk_grads):
        torch_update(*want, g, step=step, inv_scale=inv, coef=None, **hyper)
    return outs, wants, weights, counts, chunk_grads


@pytest.mark.parametrize("threads", [1, 2])
def test_norms_taken_beside_a_runs_passes_have_torchs_bits_and_leave_each_chunks(threads):
    """`OnePass.update_chunks` with ``beside`` (`gradients.Beside`: norms claimed from `PendingNorms` for two updates,
    the first claim taking every kept gradient): in the same parallel region, each norm is `grad_norm`'s torch bits
    and every chunk torch's fused kernel's, on 1 and 2 threads. Nothing is left kept, so a later take computes
    nothing; a claim recorded is not given back."""
    from fuyou_strategy.optim.gradients import Beside, NormTake, PendingNorms

    one = one_pass()
    if one.norm_layout is None:
        pytest.skip("torch's norm order here is none the kernel knows: the norms are torch's own")
    gen = torch.Generator().manual_seed(29)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
    inv = torch.tensor(2.0 ** -7)
    pending = PendingNorms()
    sizes = (300_001, 4097, 33, 20000, 77)
    grads, got = keep_gradients(pending, gen, sizes, (torch.float32, torch.bfloat16, torch.float16, torch.float32,
                                                      torch.bfloat16), inv)
    beside = Beside.claim([NormTake(pending, 0, one), None, NormTake(pending, 3, one)], one)
    assert [len(claim.batch) for claim in beside.claims] == [5]  # the second was taken with the first
    big = one.module.grain_blocks() * one.block * 2 + 5  # three grains (and a ragged end)
    lengths = [big, one.block * 3 + 1, one.block * 7, 5]
    outs, wants, weights, counts, chunk_grads = chunks_and_reference(gen, lengths, inv, hyper)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        taken = one.update_chunks(outs, [None] * len(outs), chunk_grads, weights, lengths, counts=counts,
                                  inv_scale=inv, coef=None, beside=beside, **hyper)
    finally:
        torch.set_num_threads(before)
    beside.record(taken)
    for t, (out, (want, _step), weight) in enumerate(zip(outs, wants, weights)):
        assert torch.equal(out.view(torch.int32), torch.cat(want).view(torch.int32)), t
        assert torch.equal(weight, want[0].to(torch.bfloat16)), t
    assert sorted(got) == list(range(len(sizes)))
    for i, g in enumerate(grads):
        assert torch.equal(got[i].view(torch.int32), grad_norm(g, inv).view(torch.int32)), (i, g.dtype)
    beside.give_back()  # recorded: nothing goes back
    got.clear()
    for i in range(len(sizes)):
        pending.take(i, one)
    assert got == {}


@pytest.mark.parametrize("threads", [1, 2])
def test_norms_carried_across_calls_pause_where_the_passes_end_and_keep_torchs_bits(threads):
    """`OnePass.update_chunks` with ``last=False`` (a job's chunks one call each, `update_job`): a norm goes on only
    while the call's blocks last and is carried on by the next call from where it paused (`Beside.progress`), the
    last call finishing every norm, and the norms come back from the call that finished them, none before (the
    caller then takes none in its later calls); each norm is `grad_norm`'s torch bits and each chunk torch's fused
    kernel's.
    Deterministic where it pauses: a call with no whole block takes the largest norm one step further on one thread
    (the last thread takes no norm before the last call), and on one thread no norm is taken before the last call."""
    from fuyou_strategy.optim.gradients import Beside, NormTake, PendingNorms

    one = one_pass()
    if one.norm_layout is None:
        pytest.skip("torch's norm order here is none the kernel knows: the norms are torch's own")
    gen = torch.Generator().manual_seed(31)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
    inv = torch.tensor(2.0 ** -7)
    pending = PendingNorms()
    sizes = (2_000_003, 700_001, 4097)  # the largest first in the pass, whatever the claim's order
    dtypes = (torch.bfloat16, torch.float32, torch.float16)
    grads, got = keep_gradients(pending, gen, sizes, dtypes, inv)
    beside = Beside.claim([NormTake(pending, 1, one)], one)
    order = list(beside.claims[0].batch)  # the claiming update's own first
    largest = order.index(0)
    # chunks of fewer elements than a block (no whole block: the pass has nothing to share), then of a grain each
    lengths = [5, 7, 3] + [one.module.grain_blocks() * one.block] * 4 + [one.block * 3 + 1]
    outs, wants, weights, counts, chunk_grads = chunks_and_reference(gen, lengths, inv, hyper)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    positions = []
    try:
        for t in range(len(lengths)):
            taking = beside if not beside.settled else None
            taken = one.update_chunk(outs[t], None, None, chunk_grads[t], weights[t], n=lengths[t],
                                     step=wants[t][1], count=counts[t], inv_scale=inv, coef=None, beside=taking,
                                     last=t == len(lengths) - 1, **hyper)
            if taking is not None:
                assert (taken != []) == all(p.done for p in beside.progress), t
                if taken:
                    beside.record(taken)
            if t < len(lengths) - 1:
                positions.append([p.position for p in beside.progress])
                assert not any(p.done for p in beside.progress) or threads == 2, t  # one thread: none taken yet
    finally:
        torch.set_num_threads(before)
    assert beside.settled
    if threads == 1:
        assert all(p == [0, 0, 0] for p in positions), positions
    else:
        # the calls without a whole block: the largest norm one step further each, the others untouched
        steps = [p[largest] for p in positions[:3]]
        assert 0 < steps[0] < steps[1] < steps[2] < sizes[0], positions
        assert steps[1] == 2 * steps[0] and steps[2] == 3 * steps[0], positions
        assert all(p[i] == 0 for p in positions[:3] for i in range(3) if i != largest), positions
    assert all(p.done for p in beside.progress)
    for t, (out, (want, _step), weight) in enumerate(zip(outs, wants, weights)):
        assert torch.equal(out.view(torch.int32), torch.cat(want).view(torch.int32)), t
        assert torch.equal(weight, want[0].to(torch.bfloat16)), t
    assert sorted(got) == [0, 1, 2]
    for i, g in enumerate(grads):
        assert torch.equal(got[i].view(torch.int32), grad_norm(g, inv).view(torch.int32)), (i, g.dtype)


def test_a_claim_given_back_leaves_the_others_norms_to_their_own_updates():
    """An update that claimed other updates' norms to take beside its pass and failed gives them back
    (`Beside.give_back`): its own is not kept again, each other one is taken by its own update's `take`, once, with
    torch's bits."""
    from fuyou_strategy.optim.gradients import Beside, NormTake, PendingNorms

    one = one_pass()
    if one.norm_layout is None:
        pytest.skip("torch's norm order here is none the kernel knows: the norms are torch's own")
    pending = PendingNorms()
    grads, got = keep_gradients(pending, torch.Generator().manual_seed(5), (1000, 333, 4096),
                                (torch.float32, torch.bfloat16, torch.float32), None)
    beside = Beside.claim([NormTake(pending, 1, one)], one)
    assert sorted(beside.claims[0].batch) == [0, 1, 2]
    beside.give_back()
    beside.give_back()  # once only
    for i in (0, 2):
        pending.take(i, one)
    assert sorted(got) == [0, 2]  # 0's take took 2's beside it; 1 was the failed update's own
    for i in (0, 2):
        assert torch.equal(got[i].view(torch.int32), grad_norm(grads[i], None).view(torch.int32)), i
    pending.take(1, one)
    assert sorted(got) == [0, 2]


@pytest.mark.parametrize("schedule,split", [("backward", "all"), ("next_forward", "all"), ("backward", "none"),
                                            ("next_forward", "none"), ("auto", "mixed")])
def test_training_with_the_one_pass_is_bitwise_torchs_and_the_same_as_torchs_kernel(tmp_path, schedule, split):
    """test_schedule's run (clipping that bites, a skipped step, accumulation) with the state in RAM (the
    speculative update reads the active chunk and writes the unfilled shadow; the exact one in place) and on the
    SSD (the fp32 parameter holds the master): the one pass and torch's kernel give torch's AdamW(fused=True)."""
    one_pass()
    host_state = {"all": "768KiB", "none": 0, "mixed": "96KiB"}[split]
    model = tiny_causal_lm("llama")
    ref_model = copy.deepcopy(model)
    ref_losses = reference(ref_model)
    runs = {}
    for kernel in ("one_pass", "torch"):
        (tmp_path / kernel).mkdir()
        run_model = copy.deepcopy(model)
        engine = FuyouEngine(run_model, torch.optim.AdamW(decay_groups(run_model), lr=3e-3, fused=True),
                             max_grad_norm=MAX_NORM, config=config(tmp_path / kernel, schedule, host_state=host_state,
                                                                   update_kernel=kernel))
        losses, _ = train(run_model, engine.optimizer, lambda last, e=engine: e.begin_micro_batch(update=last))
        summary = engine.summary()
        stats = engine.optimizer.stats
        engine.close()
        assert summary["update_kernel"] == kernel, summary["update_kernel_reason"]
        assert stats.skips == 1 and stats.steps == STEPS - 1 and stats.clipped >= 1
        runs[kernel] = (losses, run_model)
    for kernel, (losses, run_model) in runs.items():
        assert losses == ref_losses, kernel
        for (name, p), q in zip(run_model.named_parameters(), ref_model.parameters()):
            assert torch.equal(p, q), (kernel, name)


@pytest.mark.parametrize("split", ["all", "none", "all-late"])
def test_a_speculative_updates_norm_is_taken_beside_its_pass_with_torchs_bits(tmp_path, monkeypatch, split):
    """test_schedule's run under the ``backward`` schedule, state in RAM (grouped jobs, `OptimizerState.group_job`),
    on the SSD (a job per parameter, `update_job`, chunks one at a time) and in RAM with staged gradients and weights
    (``all-late``: the late-copy mode, as on a GPU: a job per parameter, its chunks lent together and passed one call
    each): every speculative update's gradient norm is taken by its pass, beside the updates
    (`OnePass.update_chunks`'s ``beside``), none by the norm kernel alone before it; with the chunks lent together,
    beside every chunk's pass, finished by the last (``last``); and the run is torch's AdamW(fused=True) after
    ``clip_grad_norm_`` bit for bit (clipping bites: the norms decide it)."""
    from fuyou_strategy.device import late_copies, late_copies_enabled

    one_pass()
    model = tiny_causal_lm("llama")
    ref_model = copy.deepcopy(model)
    ref_losses = reference(ref_model)
    calls = {"beside": 0, "norms beside": 0, "alone": 0}
    passes: dict[int, list[int]] = {}  # each Beside's calls: how many norms each returned
    held = []  # each Beside, so that no id is reused
    real_chunks, real_norms = onepass.OnePass.update_chunks, onepass.OnePass.norms

    def update_chunks(self, *args, beside=None, last=True, **kwargs):
        taken = real_chunks(self, *args, beside=beside, last=last, **kwargs)
        calls["beside"] += beside is not None
        calls["norms beside"] += len(taken)
        if beside is not None:
            assert not beside.settled  # recorded by the caller once returned, and not passed again
            passes.setdefault(id(beside), []).append(len(taken))
            held.append(beside)
            assert taken or not last  # the last call finishes them
        return taken

    def norms(self, *args, **kwargs):
        calls["alone"] += 1
        return real_norms(self, *args, **kwargs)

    monkeypatch.setattr(onepass.OnePass, "update_chunks", update_chunks)
    monkeypatch.setattr(onepass.OnePass, "norms", norms)
    host_state = {"all": "768KiB", "none": 0, "all-late": "768KiB"}[split]
    with late_copies() if split == "all-late" else contextlib.nullcontext():
        engine = FuyouEngine(model, torch.optim.AdamW(decay_groups(model), lr=3e-3, fused=True),
                             max_grad_norm=MAX_NORM,
                             config=config(tmp_path, "backward", host_state=host_state, update_kernel="one_pass"))
        losses, _ = train(model, engine.optimizer, lambda last: engine.begin_micro_batch(update=last))
        stats = engine.optimizer.stats
        late = late_copies_enabled()  # also for "all" where FUYOU_ASYNC_DEVICE sets the mode for the whole run
        engine.close()
    assert stats.skips == 1 and stats.clipped >= 1
    params = len(list(model.parameters()))
    assert calls["beside"] >= 1 and calls["alone"] == 0, calls
    assert calls["norms beside"] == params * STEPS, calls  # every parameter's, every step, once
    # each Beside's norms came back once, from the last call it was passed to; with the chunks lent together, carried
    # across calls (on the worker's one thread here, `"auto"` on a CPU: every norm in the job's last call)
    assert all(seq[-1] and not any(seq[:-1]) for seq in passes.values()), passes
    carried = max(len(seq) for seq in passes.values())
    assert carried > 1 if late and split != "none" else carried == 1, passes
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name


def test_bf16_weights_and_gradients_take_the_one_pass_and_match_torch_on_their_upcast(tmp_path):
    """bf16 compute weights, fp32 masters: each step's bf16 gradient read as it is, the bf16 weight written in the
    pass; torch's reference: AdamW(fused=True) on fp32 masters with the gradient upcast, the weight cast down."""
    one_pass()
    torch.manual_seed(0)
    shapes = [(300, 7), (1001,), (64, 64)]
    params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().to(torch.float32)) for p in params]  # the masters start as the weights
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05, fused=True)
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], chunk_size="8KiB", host_memory_budget="2MiB", host_state="1MiB",
                      update_kernel="one_pass", optimizer_schedule="next_forward")
    with FuyouAdamW(params, lr=1e-2, weight_decay=0.05, config=cfg) as opt:
        assert opt.control.kernel == "one_pass"
        for _ in range(4):
            grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]
            for p, q, g in zip(params, ref, grads):
                p.grad, q.grad = g.clone(), g.to(torch.float32)
            opt.step()
            ref_opt.step()
            opt.flush()
            for p, q in zip(params, ref):
                assert torch.equal(opt.read_state(p)["master"].view_as(q), q.detach())
                assert torch.equal(p.detach(), q.detach().to(torch.bfloat16))


def test_update_kernel_is_checked_and_one_pass_says_why_it_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match=r"update_kernel: got 'fastest'; expected one of 'auto', 'one_pass', 'torch'"):
        FuyouConfig(update_kernel="fastest")
    params = [torch.nn.Parameter(torch.randn(100))]
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], host_memory_budget="64MiB", update_kernel="one_pass")
    with pytest.raises(ConfigError, match=r"update_kernel: got 'one_pass', but fused=False .* use update_kernel='auto'"):
        FuyouAdamW(params, config=cfg, fused=False)
    with FuyouAdamW(params, config=cfg.replace(update_kernel="auto"), fused=False) as opt:
        assert opt.control.kernel == "torch" and "fused=False" in opt.control.kernel_reason
    with FuyouAdamW(params, config=cfg.replace(update_kernel="torch")) as opt:
        assert opt.control.kernel == "torch" and opt.control.figures().update_kernel == "torch"


def test_a_pass_that_does_not_build_or_differs_from_torch_falls_back_and_says_so(tmp_path, monkeypatch, caplog):
    """No compiler (the build raises) or a build whose bits differ (`check` fails): ``"auto"`` takes torch's kernel
    and warns once, naming why; ``"one_pass"`` refuses."""
    params = [torch.nn.Parameter(torch.randn(100))]
    cfg = FuyouConfig(swap_dirs=[str(tmp_path)], host_memory_budget="64MiB")

    def no_compiler(capability, cflags):
        raise RuntimeError("Error building extension: c++: command not found")

    for broken in ("build", "bits"):
        with monkeypatch.context() as patch:
            patch.setattr(onepass, "_found", {})
            if broken == "build":
                patch.setattr(onepass, "_cached_build", no_compiler)
            else:
                patch.setattr(onepass, "check", lambda one: "exp_avg differed from torch's kernel in 3 of 100")
            with caplog.at_level("WARNING", logger="fuyou_strategy"):
                with FuyouAdamW(params, config=cfg) as opt:
                    assert opt.control.kernel == "torch"
                with FuyouAdamW(params, config=cfg) as opt:  # the same process: found once, said once
                    assert opt.control.kernel == "torch"
            said = [r.getMessage() for r in caplog.records if "one-pass" in r.getMessage()]
            want = "c\\+\\+: command not found" if broken == "build" else "exp_avg differed"
            assert len(said) == 1 and re.search(want, said[0]), said
            caplog.clear()
            with pytest.raises(ConfigError, match="update_kernel: got 'one_pass', but the one-pass update"):
                FuyouAdamW(params, config=cfg.replace(update_kernel="one_pass"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gradient_norm_upcast_gives_the_bits_of_torchs_norm_in_fp32(dtype):
    """`grad_norm` upcasts a half-width gradient into the thread's scratch before torch's fp32 norm: the same bits
    as ``vector_norm(..., dtype=float32)`` on it, over sizes around every vector width, shapes and scales."""
    gen = torch.Generator().manual_seed(3)
    sizes = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255, 256, 257, 4095, 4097, 65535, 65537, 1_000_003]
    for n in sizes:
        for scale in (1e-6, 1e-2, 30.0):
            for inv_scale in (None, torch.tensor(2.0 ** -12)):
                g = (torch.randn(n, generator=gen) * scale).to(dtype)
                x = g.to(torch.float32) * inv_scale if inv_scale is not None else g
                want = torch.linalg.vector_norm(x, 2, dtype=torch.float32)
                assert torch.equal(grad_norm(g, inv_scale), want), (n, scale, inv_scale)
    g = (torch.randn(768, 3072, generator=gen) * 1e-2).to(dtype)
    assert torch.equal(grad_norm(g, None), torch.linalg.vector_norm(g, 2, dtype=torch.float32))


def test_the_norm_kernel_gives_torchs_norm_bits_over_sizes_dtypes_shapes_and_threads():
    """`OnePass.norms` is `grad_norm`'s torch path bit for bit: every size around both accumulator widths and
    long ones, every gradient dtype, tiny to large, with and without unscaling, a 2-D gradient, one gradient alone
    and many shared out among 1 or 2 intra-op threads; and `grad_norm` takes it for what it `reads`."""
    one = one_pass()
    assert one.norm_layout in onepass.NORM_LAYOUTS, "torch's norm order on this machine is not one the pass knows"
    gen = torch.Generator().manual_seed(5)
    sizes = [*range(1, 70), 255, 256, 257, 4095, 4097, 65535, 65537, 1_000_003]
    grads = [(torch.randn(n, generator=gen) * scale).to(dtype) for n in sizes for scale in (1e-6, 1e-2, 30.0)
             for dtype in DTYPES]
    grads.append((torch.randn(768, 3072, generator=gen) * 1e-2).to(torch.bfloat16))
    threads = torch.get_num_threads()
    try:
        for inv_scale in (None, torch.tensor(2.0 ** -12)):
            want = [grad_norm(g, inv_scale) for g in grads]  # torch's path (no kernel)
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                got = one.norms(grads, inv_scale)
                wrong = [(g.dtype, tuple(g.shape)) for g, a, b in zip(grads, got, want) if not torch.equal(a, b)]
                assert not wrong, (inv_scale, n_threads, wrong[:5])
            for g, w in zip(grads[::7], want[::7]):
                assert one.reads(g) and torch.equal(grad_norm(g, inv_scale, one), w)
    finally:
        torch.set_num_threads(threads)
    assert not one.reads(torch.randn(8, 8).t()) and not one.reads(torch.randn(8, dtype=torch.float64))


def test_a_norm_order_that_differs_from_torchs_is_not_used(monkeypatch):
    """With only a layout torch does not sum in to try, `find_norm_layout` finds none: `reads` takes nothing, and
    `grad_norm` gives torch's own norm."""
    one = one_pass()
    found = one.norm_layout
    wrong = next(layout for layout in onepass.NORM_LAYOUTS if layout != found)
    monkeypatch.setattr(onepass, "NORM_LAYOUTS", (wrong,))
    try:
        assert onepass.find_norm_layout(one) is None and not one.reads(torch.randn(100))
        g = torch.randn(1001)
        assert torch.equal(grad_norm(g, None, one), torch.linalg.vector_norm(g, 2))
    finally:
        one.norm_layout = found


@pytest.mark.slow
def test_the_avx2_build_gives_torchs_bits_where_torch_dispatches_avx2(tmp_path):
    """``ATEN_CPU_CAPABILITY=avx2`` makes torch dispatch its AVX2 kernels: the pass is built for AVX2 (its own
    cache entry) and passes the bitwise check against them. Skipped on a CPU without AVX2."""
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 on this CPU")
    code = ("import torch; from fuyou_strategy.optim import onepass; one, why = onepass.load(); "
            "print(torch.backends.cpu.get_cpu_capability(), one is not None and one.capability, why)")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:2] == ["AVX2", "AVX2"] and "bitwise" in out.stdout, out.stdout
