"""Deliberate bugs, one at a time: does the test suite still catch each one? Old suite against new.

    .venv/bin/python tests/mutation_check.py                    # every bug, the old suite (--old) and this one
    .venv/bin/python tests/mutation_check.py --only clip-redo   # one bug (ids: --list)
    .venv/bin/python tests/mutation_check.py --new-only         # this suite alone (after a change to the tests)

Each bug (`MUTANTS`) is a small change to a copy of ``src/`` and names the test files that should catch it. Each
suite runs those files against its own code with the bug in it (``PYTHONPATH`` puts the mutated copy before the
installed package, and every process the tests start inherits it): the old suite, taken from git at ``--old``
(default: the commit before the suite was made faster) with that commit's ``src/``, as its CI ran it (``pytest
FILES``, then ``FUYOU_ASYNC_DEVICE=2 pytest -m device FILES``); this one with the working tree's ``src/``, as the
README runs it (``pytest -n 2 FILES``: the late-copy runs are part of it). A bug is caught when a run fails.
First both suites run all the named files on their unmutated code: one that fails there makes its rows
meaningless, and the script stops.

Prints a table (bug, files, caught by the old suite, caught by this one, seconds) and writes it as JSON
(``--json``). Not collected by pytest (its name does not start with ``test_``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD_REF = "92aa3bf"  # main before the suite was made faster (issue 51)
# The files the old CI ran a second time with late copies (its conftest's DEVICE_SUITES).
OLD_DEVICE_SUITES = {"test_device.py", "test_on_device.py", "test_optimizer.py", "test_schedule.py", "test_pipeline.py",
                     "test_activations.py", "test_weights.py", "test_weights_trainable.py"}


@dataclass(frozen=True)
class Mutant:
    id: str
    what: str
    file: str  # under src/fuyou_strategy/
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # test files that should catch it (under tests/)
    before: tuple[str, str] | None = None  # (old, new) where the old suite's code reads otherwise
    before_file: str | None = None  # the file, where the old suite's code is in another


MUTANTS = [
    Mutant("grad-copy-wait", "a gradient's device-to-host copy is not waited for before the update reads it",
           "optim/gradients.py", "            host, copy = self.copy_out(grad)\n            copy.wait()\n",
           "            host, copy = self.copy_out(grad)\n", ("test_device.py", "test_optimizer.py", "test_weights_trainable.py")),
    Mutant("copy-wait-late", "a device copy's wait returns before a late copy landed",
           "device.py", "        if self._late is not None:\n            self._late.wait(timeout)\n",
           "        if self._late is not None:\n            pass\n", ("test_device.py", "test_activations.py")),
    Mutant("bias-correction", "AdamW's bias correction uses the step after the one being taken",
           "optim/kernels.py", "[exp_avg_sq], [step + 1], found_inf=found_inf, **hyper)",
           "[exp_avg_sq], [step + 2], found_inf=found_inf, **hyper)",
           ("test_optimizer.py",), ("[step + 1], amsgrad=False", "[step + 2], amsgrad=False"),
           before_file="optim/state.py"),
    Mutant("group-bias-correction", "a grouped job's bias correction uses the step after the one being taken",
           "optim/state.py", "[ps.index for ps in pss])] + 1", "[ps.index for ps in pss])] + 2",
           ("test_device_state.py",)),
    Mutant("bias-correction-compact", "the compact formats' second-moment bias correction is one step off",
           "optim/formats.py", "    bias_correction2 = 1 - beta2**step\n", "    bias_correction2 = 1 - beta2**(step + 1)\n",
           ("test_state_formats.py",)),
    Mutant("clip-redo", "the redo after a rollback forgets the clip coefficient",
           "optim/schedule.py", "            p.updates.queue_many(queued, p.gradients.at_step, coef=coef, exact=False)",
           "            p.updates.queue_many(queued, p.gradients.at_step, coef=None, exact=False)", ("test_schedule.py",),
           ("                p.updates.queue(ps, p.gradients.at_step(ps), coef=coef)",
            "                p.updates.queue(ps, p.gradients.at_step(ps), coef=None)")),
    Mutant("rollback-shadow", "an undone window keeps its shadow-slot writes (no rollback)",
           "optim/schedule.py", "        p = self.parts\n        p.state.rollback()\n        p.window.partial.clear()",
           "        p = self.parts\n        p.window.partial.clear()", ("test_schedule.py",)),
    Mutant("meta-fsync", "a save's optimizer.json is not fsynced",
           "optim/checkpoint.py", "        json.dump(meta, f, indent=1)\n        f.flush()\n        os.fsync(f.fileno())",
           "        json.dump(meta, f, indent=1)\n        f.flush()", ("test_optimizer_checkpoint.py", "test_power_cut.py")),
    Mutant("save-rename", "a whole save is not renamed from its temporary name into place",
           "optim/checkpoint.py", "        try:\n            tmp.rename(folder / token)\n            fsync_dir(folder)\n"
           "        except BaseException:\n            shutil.rmtree(tmp, ignore_errors=True)\n            raise\n        return meta",
           "        try:\n            fsync_dir(folder)\n"
           "        except BaseException:\n            shutil.rmtree(tmp, ignore_errors=True)\n            raise\n        return meta",
           ("test_optimizer_checkpoint.py",),
           before=("        try:\n            tmp.rename(folder / token)\n            _fsync_dir(folder)\n",
                   "        try:\n            _fsync_dir(folder)\n")),
    Mutant("commit-order", "the earlier saves are removed before the framework's checkpoint files are durable",
           "commit.py", "    make_durable(*framework_files)\n    if pending is not None:\n"
           "        remove_versions(pending.folder, keep=pending.token)\n",
           "    if pending is not None:\n        remove_versions(pending.folder, keep=pending.token)\n"
           "    make_durable(*framework_files)\n", ("test_commit.py",)),
    Mutant("checksum", "a state file's checksum mismatch is not reported",
           "optim/checkpoint.py", "        if self._bad:\n", "        if False:\n", ("test_optimizer_checkpoint.py",)),
    Mutant("token", "a save's optimizer.json is not checked against its folder's token",
           "optim/checkpoint.py", "    if _TOKEN.fullmatch(save.name) and meta.get(\"token\") != save.name:",
           "    if False:", ("test_optimizer_checkpoint.py",)),
    Mutant("stale-temp", "a dead writer's temporary save folder is not recognised as stale",
           "optim/checkpoint.py", "    reason = temp_writer_gone(path, pid)\n", "    reason = None\n",
           ("test_optimizer_checkpoint.py", "test_cli.py", "test_store.py")),
    Mutant("shard-owner", "each rank takes the next rank's parameters as its own (owner off by one)",
           "optim/distributed.py", "        return self.owner[ps.index] == self.rank",
           "        return (self.owner[ps.index] + 1) % self.world == self.rank", ("test_distributed.py",)),
    Mutant("pool-lent", "a buffer given back to the host pool is not subtracted from what is lent",
           "storage/pool.py", "        with self._cond:\n            self._lent -= capacity\n            if self._closed:",
           "        with self._cond:\n            if self._closed:", ("test_pool.py", "test_host_budget.py")),
    Mutant("prefetch-block", "backward reads back the activations of the blocks after the one it reached",
           "activations/swap.py",
           "        for j in range(block, block - self.config.activation_prefetch_blocks - 1, -1):",
           "        for j in range(block - 1, block - self.config.activation_prefetch_blocks - 2, -1):",
           ("test_activations.py", "test_pipeline.py")),
    Mutant("weight-prefetch", "backward reads ahead the streamed weights of the wrong blocks",
           "params/streaming.py", "            for j in range(i - 1, i - self.k - 1, -1):",
           "            for j in range(i + 1, i - self.k - 1, -1):", ("test_weights.py", "test_weights_trainable.py")),
    Mutant("scaler-backoff", "the loss scale grows where it should back off (found_inf ignored)",
           "optim/scaler.py", "torch.full((), float(found_inf)),", "torch.full((), 0.0),",
           ("test_schedule.py", "test_on_device.py")),
    Mutant("accumulate", "every micro-batch's backward ends the window (gradient accumulation ignored)",
           "engine.py", "            self.optimizer.updates_enabled = update\n",
           "            self.optimizer.updates_enabled = True\n", ("test_hf.py", "test_lightning.py")),
    Mutant("onepass-tail", "the one pass leaves the ragged end of a chunk (past its last whole block) un-updated",
           "optim/onepass.py", "``masters_in_place``).\"\"\"\n        src = out if source is None else source\n",
           "``masters_in_place``).\"\"\"\n        return\n",
           ("test_onepass.py",)),
    Mutant("onepass-unscale", "the compiled pass divides by the unscale factor instead of multiplying (rebuilt; "
           "its bitwise check at load must refuse it)", "optim/csrc/adamw_pass.cpp",
           "grad_vec = grad_vec * k.inv_scale;", "grad_vec = grad_vec / k.inv_scale;", ("test_onepass.py",)),
    Mutant("unfilled-lend", "a shadow chunk lent unfilled comes without the active chunk to read from",
           "storage/store.py", "                    source = entry.chunk_memory(k, src)\n",
           "                    source = None\n", ("test_onepass.py", "test_host_state.py")),
    Mutant("staged-norm-wait", "a gradient's host copy made at step() for its norm is read before it landed",
           "optim/gradients.py", "                kept._landed()  # not handed to the worker yet: this thread's to wait for\n",
           "                pass\n", ("test_device.py",)),
    Mutant("staged-kept", "the host copies made at step() that no update took are never given back to the pool",
           "optim/gradients.py",
           "        staged = [*self._staged.values(), *(early[1] for early in self._early.values())]\n",
           "        staged = []\n",
           ("test_device.py",)),
    Mutant("kept-views", "the views a lent chunk keeps with its slot's memory are kept per slot, not per chunk",
           "storage/store.py", 'return self.entry.memory[self.slot].kept((self.k, "lent", key), make)',
           'return self.entry.memory[self.slot].kept(("lent", key), make)',
           ("test_host_state.py", "test_device_state.py")),
    Mutant("decided-skip-counts", "a step decided on the device that turns out non-finite keeps its advanced step counts",
           "optim/schedule.py", "                self.advance(u.stepped, -1.0)", "                pass",
           ("test_device_state.py",)),
    Mutant("counts-all", "a step advances the count of every parameter, not only of those it updated",
           "optim/schedule.py", "        if len(index) == self.counts.numel():", "        if True:",
           ("test_optimizer.py",)),
    Mutant("device-norms-each", "step() takes the device tier's gradient norms one tensor at a time, not one call a list",
           "optim/gradients.py", "    for ps in params:\n        grad = ps.param.grad\n        groups.setdefault(",
           "    for ps in params[:0]:\n        grad = ps.param.grad\n        groups.setdefault(", ("test_device_state.py",)),
    Mutant("decided-found-inf", "the device tier's updates of a step decided on the device ignore its found_inf flag",
           "optim/state.py", "avgs, sqs, steps, found_inf=found_inf,", "avgs, sqs, steps, found_inf=None,",
           ("test_device_state.py", "test_on_device.py")),
    Mutant("decided-found-inf-each", "a device-tier update in a job of its own ignores the found_inf flag of a step "
           "decided on the device", "optim/state.py", "step, fused=fused, found_inf=found_inf, **hyper)",
           "step, fused=fused, found_inf=None, **hyper)", ("test_device_state.py",)),
    Mutant("clip-in-place-speculative", "a speculative grouped device-tier update clips its gradients in place, "
           "though its redo reads them again", "optim/state.py",
           "grads = fp32_gradients(raws, inv_scale, coef, consume=exact)",
           "grads = fp32_gradients(raws, inv_scale, coef, consume=True)", ("test_device_state.py",)),
    Mutant("clip-in-place-raw", "gradients the caller reads again are unscaled and clipped in place",
           "optim/kernels.py", "fresh = consume or all(g is not raw for g, raw in zip(grads, raws))",
           "fresh = True", ("test_device_state.py",)),
    Mutant("flat-weight-stale", "a parameter's kept flat view is used after its memory was replaced",
           "optim/state.py", "if ptr != self.param.data_ptr() or flat is None:", "if flat is None:",
           ("test_optimizer.py",)),
    Mutant("group-counts-index", "a grouped job reads the step counts of the first parameters, not its members'",
           "optim/state.py", "counts = counts[torch.tensor([ps.index for ps in pss])]", "counts = counts[: len(pss)]",
           ("test_optimizer.py", "test_device_state.py")),
    Mutant("chunks-tail-step", "the ragged end of a chunk in a list call gives torch's kernel the count after the "
           "update as its step", "optim/onepass.py", "step = torch.tensor(counts[i] - 1.0, dtype=torch.float32)",
           "step = torch.tensor(counts[i], dtype=torch.float32)", ("test_onepass.py",)),
    Mutant("auto-device-exact", "auto measures backward first though the whole state is on an accelerator's device tier",
           "optim/control.py", "        if owned and all(read_on_host(ps.param) for ps in owned) and",
           "        if False and all(read_on_host(ps.param) for ps in owned) and", ("test_device_state.py",)),
    Mutant("decided-save-unread", "a save reads the step counts before the outcome of a step decided on the device",
           "optim/saves.py", "        self.settle()\n        owned = self.sharding.owned(self.params)\n        steps",
           "        owned = self.sharding.owned(self.params)\n        steps", ("test_device_state.py",)),
    Mutant("batch-chunk", "each chunk of a batched update (state in RAM) is updated in its first chunk's place",
           "optim/state.py", "                        took, n = compute(j, buf, stored, futures, landing, beside,",
           "                        took, n = compute(k, buf, stored, futures, landing, beside,",
           ("test_host_state.py", "test_device.py")),
    Mutant("group-fill", "a grouped redo on the device tier updates shadow chunks never filled from the active ones",
           "optim/state.py", "                torch._foreach_copy_(fill, sources)", "                pass",
           ("test_device_state.py",)),
    Mutant("group-cut", "a grouped job takes parameters without end", "optim/updates.py",
           "        if kind is None or kind != self._run_kind or self._run_elems >= GROUP_ELEMENTS:",
           "        if kind is None or kind != self._run_kind:", ("test_device_state.py",)),
    Mutant("staged-weight", "a half-precision weight the pass wrote into a host buffer is never copied to its parameter",
           "optim/updates.py", "        return start_copy(ps.flat_weight()[start : start + n], weight, after_compute=True)",
           "        return Copy()", ("test_on_device.py",)),
    Mutant("staged-copy-unwaited", "a staged weight's buffer goes back to the pool before its copy to the device landed",
           "optim/state.py", "                copy.wait()\n                staged.release()\n",
           "                staged.release()\n", ("test_on_device.py",)),
    Mutant("staged-copy-alone", "a staged weight's copy to the device is waited for before the next chunk's pass",
           "optim/state.py", "                        if len(landing) > 1:\n", "                        if landing:\n",
           ("test_on_device.py",)),
    Mutant("staged-last-unlanded", "an update counts as done before its last staged weight's copy landed",
           "optim/state.py", "                finally:  # the last chunk's weight is in the parameter before the update is done "
           "(or fails)\n                    land(landing)\n",
           "                finally:  # the last chunk's weight is in the parameter before the update is done "
           "(or fails)\n                    pass\n", ("test_on_device.py",)),
    Mutant("device-staged", "a device-tier gradient is copied to the host like the others",
           "optim/gradients.py", "        return read_on_host(tensor) and not self.updates_on_device(ps)\n",
           "        return read_on_host(tensor)\n", ("test_device_state.py",)),
    Mutant("device-shadow", "a shadow chunk lent unfilled to a device-tier update is not filled from the active one",
           "optim/state.py", "                    buf.view().copy_(source)  # update's that cannot run on this gradient",
           "                    pass", ("test_device_state.py",)),
    Mutant("device-streamed", "a streamed parameter's state stays on the device tier", "optim/state.py",
           "        left = any(ps.index in self.on_device for ps in params)\n        self.leave_device(params)\n",
           "        left = False\n", ("test_weights_trainable.py", "test_planner_weights.py")),
    Mutant("streamed-holds-master", "a streamed parameter is still taken to hold its master", "optim/state.py",
           "        params = list(params)\n        self._hold(params, False)\n", "        params = list(params)\n",
           ("test_planner_weights.py",)),
    Mutant("streamed-onto-device", "the plan's device tier takes the state of parameters about to be streamed",
           "optim/control.py", "leaving=[ps for ps in owned if id(ps.param) in leaving])", "leaving=[])",
           ("test_device_state.py",)),
    Mutant("streamed-no-refill", "the device tier's room a streamed block's state leaves stays empty",
           "optim/control.py", "        if left_device:  # the room", "        if False:  # the room",
           ("test_planner_weights.py",)),
    Mutant("state-split-before-streaming", "the host tier's share is recorded before a streamed block's state moved",
           "engine.py", "        if weights:\n            self._install_streamer(weights)\n"
           "        self._record_state_tiers(device_why, in_ram, \"beside the plan's activations and weights\")\n",
           "        self._record_state_tiers(device_why, in_ram, \"beside the plan's activations and weights\")\n"
           "        if weights:\n            self._install_streamer(weights)\n", ("test_planner_weights.py",)),
    Mutant("device-headroom", "the engine moves the plan's device tier whatever the warm-up's peak leaves",
           "engine.py", "want = plan.state_on_device if room is None else min(plan.state_on_device, room)",
           "want = plan.state_on_device", ("test_device_state.py",)),
    Mutant("device-no-regrow", "the device tier stays at what the warm-up's peak left, whatever the plan frees",
           "engine.py", "            if self._device_tier_asked is not None:", "            if False:",
           ("test_device_state.py",)),
    Mutant("device-cache-kept",
           "the allocator's cache is not released at the plan: the warm-up's reserve bounds the tier",
           "engine.py", "            release_cached_memory(self.device)\n", "", ("test_device_state.py",)),
    Mutant("device-regrow-each-step", "the device tier is grown after every step, not once",
           "engine.py", "asked, self._device_tier_asked = self._device_tier_asked, None",
           "asked = self._device_tier_asked", ("test_device_state.py",)),
    Mutant("device-regrow-where-room", "only a rank whose device left room makes the growth's call (a collective)",
           "engine.py", "        if self.optimizer.control.hold_state_on_device(want) > held:",
           "        if want > held and self.optimizer.control.hold_state_on_device(want) > held:",
           ("test_distributed.py",)),
    Mutant("device-regrow-compared-early", "the plan's predicted step is compared with steps that paid the tier's move",
           "engine.py", "            self.reporting.plan_moved()", "            pass", ("test_device_state.py",)),
    Mutant("device-pinned-unmeasured", "a pinned plan's device tier takes the room its steps will need",
           "engine.py", "        if room is not None and not measured:", "        if False:", ("test_device_state.py",)),
    Mutant("act-median", "the plan's activations are sized for the median micro-batch after the first step",
           "planner/profile.py", "act = [max(r[\"act\"][i] for r in main) for i in range(n)]",
           "act = [int(statistics.median(r[\"act\"][i] for r in records)) for i in range(n)]", ("test_planner.py",)),
    Mutant("fork-keeps-handler", "a forked child keeps fuyou's SIGTERM handler (a SIGTERM just before a pause hangs)",
           "storage/rundir.py", "        signal.signal(signal.SIGTERM, signal.SIG_DFL)\n\n\nos.register_at_fork",
           "        pass\n\n\nos.register_at_fork", ("test_signals.py",)),
    Mutant("batch-guard-unarmed", "a batch larger than the warm-up's goes unremarked after the plan",
           "engine.py", "                self._batch_guard.arm()", "                self._batch_guard.remove()",
           ("test_planner.py",)),
    Mutant("batch-guard-every-batch", "every larger batch warns, not the first",
           "planner/profile.py", "            self.remove()\n            warnings.warn(", "            warnings.warn(",
           ("test_planner.py",)),
    Mutant("batch-guard-eval", "a forward without gradients counts as a batch",
           "planner/profile.py", "        if not torch.is_grad_enabled():\n            return\n        x = block_input",
           "        x = block_input", ("test_planner.py",)),
    Mutant("device-both-tiers", "the host tier also takes parameters the device tier holds", "optim/state.py",
           "skip = not self._device_eligible(ps) if device else ps.index in self.on_device",
           "skip = not self._device_eligible(ps) if device else False", ("test_device_state.py",)),
    Mutant("device-oom", "a device out of memory while the tier grows ends the run instead of the tier's growth",
           "optim/state.py", "                except torch.OutOfMemoryError as exc:",
           "                except ZeroDivisionError as exc:", ("test_device_state.py",)),
    Mutant("norm-tail-rounded", "the norm kernel rounds the last elements' squares where torch's loop fuses them",
           "optim/csrc/adamw_pass.cpp", "      total = std::fma(v, v, total);", "      total = total + v * v;",
           ("test_onepass.py",)),
    Mutant("norm-block-order", "the norm kernel adds a widened block's second vector before its first",
           "optim/csrc/adamw_pass.cpp", "        a.store(x);\n        b.store(x + fVec::size());\n",
           "        b.store(x);\n        a.store(x + fVec::size());\n", ("test_onepass.py",)),
    Mutant("norm-block-rest", "the norm kernel leaves out the elements after the last whole block (fewer than a block)",
           "optim/csrc/adamw_pass.cpp", "    add_squares<Lanes, L>(acc, x, m);\n", "    add_squares<Lanes, L>(acc, x, 0);\n",
           ("test_onepass.py",)),
    Mutant("chunks-each-thread-all", "every thread of a pass updates every grain of its chunks (no grain taken once)",
           "optim/csrc/adamw_pass.cpp",
           "    for (size_t j = next_grain.fetch_add(1); j < grains.size(); j = next_grain.fetch_add(1)) {\n",
           "    for (size_t j = 0; j < grains.size(); j++) {\n", ("test_onepass.py",)),
    Mutant("grains-first-only", "a pass leaves a chunk's blocks after its first grain un-updated",
           "optim/csrc/adamw_pass.cpp", "    for (int64_t b = 0; b < chunks[i].blocks; b += kGrainBlocks) {\n",
           "    for (int64_t b = 0; b < std::min(chunks[i].blocks, int64_t{1}); b += kGrainBlocks) {\n",
           ("test_onepass.py",)),
    Mutant("beside-norms-left", "a pass takes none of the norms given it beside its updates",
           "optim/csrc/adamw_pass.cpp",
           "    for (size_t j = with_norms ? next_norm.fetch_add(1) : nnorms; j < nnorms; j = next_norm.fetch_add(1)) {\n",
           "    for (size_t j = nnorms; j < nnorms; j = next_norm.fetch_add(1)) {\n", ("test_onepass.py",)),
    Mutant("norms-largest-first-index", "the norms taken largest first go to the places of that order, not their own",
           "optim/csrc/adamw_pass.cpp", "norms.tail_group, *norms.progress[i], pause);",
           "norms.tail_group, *norms.progress[j], pause);", ("test_onepass.py",)),
    Mutant("tile-weight-first-block", "the pass writes every block's weight of a tile from the tile's first block",
           "optim/csrc/adamw_pass.cpp",
           "        const fVec p1 = fVec::loadu(kept + (d - t0)), p2 = fVec::loadu(kept + (d - t0) + fVec::size());\n",
           "        const fVec p1 = fVec::loadu(kept), p2 = fVec::loadu(kept + fVec::size());\n", ("test_onepass.py",)),
    Mutant("tile-weight-last-block", "the pass leaves each tile's last block's weight unwritten",
           "optim/csrc/adamw_pass.cpp", "      for (int64_t d = t0; d < t1; d += kBlock) {\n        const fVec p1",
           "      for (int64_t d = t0; d + kBlock < t1; d += kBlock) {\n        const fVec p1", ("test_onepass.py",)),
    Mutant("tile-weight-first-tile", "the pass writes the weights of each grain's first tile only, leaving the later "
           "tiles' as they were (the check at load, on fewer blocks than a tile, cannot see it)",
           "optim/csrc/adamw_pass.cpp", "    if constexpr (!std::is_same_v<W, void>) {\n      for (int64_t d = t0;",
           "    if constexpr (!std::is_same_v<W, void>) {\n      if (t0 == b0 * kBlock) for (int64_t d = t0;", ("test_onepass.py",)),
    Mutant("norm-resume-sums", "a norm carried on from an earlier call starts its sums afresh",
           "optim/csrc/adamw_pass.cpp", "  Lanes acc;\n  std::memcpy(&acc, p.acc, sizeof(Lanes));\n",
           "  Lanes acc = {};\n", ("test_onepass.py",)),
    Mutant("norm-resume-position", "a norm carried on from an earlier call sums its first elements again",
           "optim/csrc/adamw_pass.cpp", "  for (int64_t d = p.position; d < blocks;) {\n",
           "  for (int64_t d = 0; d < blocks;) {\n", ("test_onepass.py",)),
    Mutant("norm-pause-never", "a norm before the last call goes on after the call's blocks are done",
           "optim/csrc/adamw_pass.cpp", "    if (d > p.position && pause()) {\n", "    if (false) {\n",
           ("test_onepass.py",)),
    Mutant("norms-every-task", "before the last call every thread takes norms, none left to the blocks",
           "optim/csrc/adamw_pass.cpp", "    take(norms.finish || (end - begin == 1 && end < tasks));\n",
           "    take(true);\n", ("test_onepass.py",)),
    Mutant("norms-one-thread-early", "on one thread a call before the last takes the norms",
           "optim/csrc/adamw_pass.cpp", "    take(norms.finish);\n", "    take(true);\n", ("test_onepass.py",)),
    Mutant("norm-first-chunk-only", "a job whose chunks are lent together takes its norm beside the first chunk's pass only",
           "optim/state.py", "landing, beside, last=j == calls[-1][0])", "landing, beside, last=True)",
           ("test_onepass.py",)),
    Mutant("beside-record-order", "the norms a pass took beside its updates go to the gradients in reverse order",
           "optim/gradients.py", "            claim.record(norms[at : at + len(claim.batch)])\n",
           "            claim.record(norms[at : at + len(claim.batch)][::-1])\n", ("test_onepass.py",)),
    Mutant("claim-settled", "a claim given back after its norms were recorded keeps the others again",
           "optim/gradients.py", "        if not self.settled:\n            self.settled = True\n",
           "        if True:\n            self.settled = True\n", ("test_onepass.py",)),
    Mutant("beside-given-back", "an update that claimed other updates' norms and failed gives none of them back",
           "optim/gradients.py",
           "            self.pending._restore({i: kept for i, kept in self.batch.items() if i != self.index})\n",
           "            pass\n", ("test_onepass.py",)),
    Mutant("early-copy-version", "an exact step takes the copy backward started of a gradient changed in place since",
           "optim/gradients.py", "ps.param.grad is tensor and version(tensor) == copied:",
           "ps.param.grad is tensor:", ("test_device.py",)),
    Mutant("early-copy-kept", "a gradient accumulated again keeps the pool buffer of the copy made before it",
           "optim/gradients.py", "        if old is not None:\n            old[1].release()\n",
           "        if old is not None:\n            pass\n", ("test_device.py",)),
    Mutant("early-copy-zero-grad", "zero_grad between backward and step() keeps the copies backward started",
           "optim/adamw.py", "            self.gradients.drop_staged()  # the copies backward's hook started",
           "            pass  # the copies backward's hook started", ("test_device.py",)),
    Mutant("early-copy-none", "an exact step's backward starts no gradient's copy",
           "optim/gradients.py", "            if not self.sharded and not speculating and window.updates:\n",
           "            if False:\n", ("test_device.py",)),
    Mutant("early-copy-untaken", "step() copies every gradient again beside the copies backward started",
           "optim/gradients.py", "        self._take_early()\n", "        pass\n", ("test_device.py",)),
    Mutant("early-copy-room", "a copy ahead of step() takes the transfers' reserved share of the pool",
           "optim/gradients.py", "kept = self.staged(ps, grad, wait=False, keep_free=self.ahead_keep_free)",
           "kept = self.staged(ps, grad, wait=False)", ("test_device.py",)),
    Mutant("readable-busy", "the store's usual-case read check passes a chunk with a second write still in flight",
           "storage/store.py", " and k in entry.written[phys] and k not in entry.writing[phys]:",
           " and k in entry.written[phys]:", ("test_store.py",)),
    Mutant("norms-unscaled", "step()'s norms of the resident gradients leave out the loss scale",
           "optim/gradients.py", "kernel.norms([held[i] for i in read], inv_scale)",
           "kernel.norms([held[i] for i in read], None)", ("test_schedule.py", "test_device_state.py")),
    Mutant("metrics-read-at-step-end", "the step's end reads a step decided on the device (waits for the device)",
           "run_report.py", "            stats, unread = self._optimizer.recorded()\n",
           "            stats, unread = self._optimizer.stats, None\n", ("test_metrics.py",)),
    Mutant("metrics-counts-carried", "a step read after its end passes its clipped and skipped counts to the next",
           "run_report.py", '            self._counted["clipped"] += clipped\n            self._counted["skipped"] += skipped\n',
           "", ("test_metrics.py",)),
    Mutant("metrics-unread", "metrics() gives a step decided on the device as it was at its end, unread",
           "run_report.py", "            _ = self._optimizer.stats  # reads it", "            pass  # reads it",
           ("test_metrics.py",)),
    Mutant("master-heal-speculate", "a window that speculates starts with masters kept only in the parameters (its "
           "rollback would restore older ones; the guard in its first update refuses it)", "optim/control.py",
           "        if self.window.schedule.speculates:\n            self.state.heal_masters()\n",
           "        if False:\n            self.state.heal_masters()\n", ("test_host_state.py",)),
    Mutant("master-heal-export", "a checkpoint saves the chunks' older masters of parameters updated in place",
           "optim/state.py",
           "        self.heal_masters(params)\n        for ps in params:\n\n            def write_chunk",
           "        for ps in params:\n\n            def write_chunk",
           ("test_host_state.py", "test_optimizer_checkpoint.py")),
    Mutant("master-heal-device", "state moved onto the device tier takes its chunks' older masters", "optim/state.py",
           "        self.heal_masters([ps for ps in owned if ps.index in keep])",
           "        self.heal_masters([])", ("test_device_state.py",)),
    Mutant("master-heal-stream", "the engine streams weights without writing the masters only they held into the "
           "state first", "engine.py", "        self.optimizer.control.heal_masters()\n", "",
           ("test_planner_weights.py",)),
    Mutant("master-in-place-tail", "a master updated in place has its ragged end written into the chunk, not the "
           "parameter", "optim/onepass.py", "master_in[:n] if master_in_place else out[:n]", "out[:n]",
           ("test_onepass.py",)),
    Mutant("metrics-every-step", "the Lightning strategy reads the metrics in steps its loggers do not write",
           "integrations/lightning.py", " or not _logs_this_step(trainer)):", "):", ("test_metrics.py",)),
]


def mutated_src(suite: Path, into: Path, mutant: Mutant | None) -> Path:
    """A copy of ``suite``'s ``src/`` at ``into`` with ``mutant`` applied (none: as it is)."""
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(suite / "src", into, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    if mutant is not None:
        path = into / "fuyou_strategy" / mutant.file
        if not path.exists() and mutant.before_file is not None:
            path = into / "fuyou_strategy" / mutant.before_file
        text = path.read_text()
        old, new = mutant.old, mutant.new
        if text.count(old) != 1 and mutant.before is not None:
            old, new = mutant.before
        if text.count(old) != 1:
            raise SystemExit(f"{mutant.id}: the code to change occurs {text.count(old)} times in {path}, not once: "
                             "update MUTANTS after the code changed")
        path.write_text(text.replace(old, new))
    return into


def old_suite(into: Path, ref: str) -> Path:
    """The repository's files at ``ref`` (tests, benchmarks, examples, docs: what the old tests read)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run(suite: Path, files: list[str], src: Path, *, old: bool, log) -> tuple[bool, float]:
    """Whether the suite at ``suite`` fails on ``files`` with ``src`` first on the path, and the seconds it took."""
    env = {k: v for k, v in os.environ.items() if k not in ("FUYOU_ASYNC_DEVICE", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(src)
    base = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *[f"tests/{f}" for f in files]]
    runs = [(base, env)]
    if old and any(f in OLD_DEVICE_SUITES for f in files):
        runs.append((base + ["-m", "device"], dict(env, FUYOU_ASYNC_DEVICE="2")))
    elif not old:
        runs = [(base + ["-n", "2"], env)]
    start = time.monotonic()
    for cmd, cmd_env in runs:
        proc = subprocess.run(cmd, cwd=suite, env=cmd_env, capture_output=True, text=True, timeout=3600)
        log.write(f"$ {' '.join(cmd)}  (in {suite})\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}\n")
        log.flush()
        if proc.returncode not in (0, 5):  # 5: no test selected by -m device
            return True, time.monotonic() - start
    return False, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default=OLD_REF, help=f"the git ref of the old suite (default {OLD_REF})")
    p.add_argument("--only", action="append", help="run this bug only (repeatable); --list shows the ids")
    p.add_argument("--new-only", action="store_true", help="run this suite only, not the old one")
    p.add_argument("--list", action="store_true", help="list the bugs and exit")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the unmutated runs (only after they passed for the same code and tests)")
    p.add_argument("--json", default="mutation_check.json", help="where to write the table (default: %(default)s)")
    p.add_argument("--log", default="mutation_check.log", help="every pytest run's output tail (default: %(default)s)")
    args = p.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.id:24} {m.what}  [{', '.join(m.tests)}]")
        return 0
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only]
    if args.only and len(chosen) != len(set(args.only)):
        raise SystemExit(f"unknown bug id in {args.only}; --list shows them")
    work = Path(tempfile.mkdtemp(prefix="fuyou-mutation-"))
    suites = {"new": ROOT} if args.new_only else {"old": old_suite(work / "old", args.old), "new": ROOT}
    rows = []
    try:
        with open(args.log, "w") as log:
            files = sorted({f for m in chosen for f in m.tests})
            for name, suite in {} if args.no_baseline else suites.items():  # unmutated code passes, or no row means anything
                src = mutated_src(suite, work / f"src-{name}", None)
                present = [f for f in files if (suite / "tests" / f).exists()]
                failed, secs = run(suite, present, src, old=name == "old", log=log)
                print(f"unmutated, {name} suite: {'FAILS' if failed else 'passes'} ({secs:.0f} s)", flush=True)
                if failed:
                    raise SystemExit(f"the {name} suite fails without a bug: see {args.log}")
            print(f"\n{'bug':24} {'old':>6} {'new':>6} {'old s':>6} {'new s':>6}  files", flush=True)
            for m in chosen:
                row = {"id": m.id, "what": m.what, "file": m.file, "tests": list(m.tests)}
                for name, suite in suites.items():
                    present = [f for f in m.tests if (suite / "tests" / f).exists()]
                    row[f"{name}_files"] = present
                    if not present:  # an older suite without the feature's tests (nor, maybe, its module)
                        row[name], row[f"{name}_s"] = False, 0.0
                        continue
                    src = mutated_src(suite, work / f"src-{name}", m)
                    row[name], row[f"{name}_s"] = run(suite, present, src, old=name == "old", log=log)
                rows.append(row)
                shown = {k: ("caught" if row[k] else "MISSED") if k in row else "-" for k in ("old", "new")}
                print(f"{m.id:24} {shown['old']:>6} {shown['new']:>6} {row.get('old_s', 0):6.0f} {row['new_s']:6.0f}  "
                      f"{', '.join(m.tests)}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lost = [r["id"] for r in rows if r.get("old") and not r["new"]]
    print(f"\n{sum(r['new'] for r in rows)} of {len(rows)} caught by this suite"
          + (f", {sum(bool(r.get('old')) for r in rows)} by the old one" if not args.new_only else "")
          + (f"; LOST: {', '.join(lost)}" if lost else ""))
    Path(args.json).write_text(json.dumps({"old_ref": None if args.new_only else args.old, "rows": rows}, indent=1))
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
