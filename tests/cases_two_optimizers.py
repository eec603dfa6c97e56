"""Two DistributedFusedAdam over one process group, trained against two unsharded torch AdamW fed
the union of every rank's batches (parity.py's rule), in the patterns of two models: backward
passes one after the other (sync/backward_order.py: each launches as it goes), and backward passes
through both models at once (their launches wait for the end of the backward and go in build
order). Every reduce-scatter launch is logged per rank: the logs must be equal on every rank (gloo
would abort on reduce-scatters of different sizes paired up, and mix same-sized ones). Imported by
cases_agreement.py, whose spawned groups (test_agreement.py) run these ``case_two_opt_*`` cases
with the others; the one pattern refused (backward passes of two threads at once) is here too.
"""
from __future__ import annotations

import time

import torch

from parity import MLP, batches
from shardamp.optim import DistributedFusedAdam

from cases_order import TINY, _backward, _bounded_group, _params, _raised

INF_STEP = 2  # the scaler pattern: an inf in model B's batch of the last rank only, at this step
TWO_STEPS = 4


class _Launches:
    """Every gradient reduce-scatter the optimizers launch: (name, bucket numel) in launch order,
    and per launch whether it was launched during the backward, before its end (overlap)."""

    def __init__(self, **opts):
        from shardamp.optim import _compat

        self.log, self.during, self.ending = [], [], 0
        for name, opt in opts.items():
            launch, sync = opt._comm.reduce_scatter, opt._grad_sync
            end = sync.end_of_backward

            def logged(out, full, name=name, launch=launch):
                self.log.append((name, full.numel()))
                self.during.append((name, _compat.in_backward() and not self.ending))
                return launch(out, full)

            def ending(end=end):
                self.ending += 1
                try:
                    end()
                finally:
                    self.ending -= 1

            opt._comm.reduce_scatter = logged
            sync.end_of_backward = ending

    def mark(self, what):
        self.log.append(what)


class _Side:
    """One side of the comparison: ours (this rank's batch, the optimizers average) or the
    unsharded reference (every rank's batch, the loss averaged over them)."""

    def __init__(self, ref, world, a, b, opt_a, opt_b, scaler):
        self.ref, self.world, self.scaler = ref, world, scaler
        self.a, self.b, self.opt_a, self.opt_b = a, b, opt_a, opt_b
        self.rows, self.denom = [], 1.0

    def data(self, rank, step):
        rows = list(enumerate(batches(step, self.world)))
        self.rows = rows if self.ref else [rows[rank]]
        self.denom = float(self.world) if self.ref else 1.0

    def loss(self, fn):
        return sum(fn(r, x, y) for r, (x, y) in self.rows) / self.denom

    def backward(self, loss):
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, opt):
        if self.scaler is None:
            opt.step()
        else:
            self.scaler.unscale_(opt)
            self.scaler.step(opt)

    def zero_grad(self):
        self.opt_a.zero_grad()
        self.opt_b.zero_grad()

    def no_sync(self):
        import contextlib

        stack = contextlib.ExitStack()
        if not self.ref:
            stack.enter_context(self.opt_a.no_sync())
            stack.enter_context(self.opt_b.no_sync())
        return stack


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _loss_a(side):
    """Model A alone (12 -> 12, an autoencoder's loss)."""
    return side.loss(lambda r, x, y: _mse(side.a(x), x))


def _backward_a_then_b(side):
    """Backward A, then backward B (model B alone: 12 -> 5 on the batch's targets)."""
    side.backward(_loss_a(side))
    side.backward(side.loss(lambda r, x, y: _mse(side.b(x), y)))


def _iter_ab(side, step):
    """(a) backward A, backward B, step A, step B."""
    side.zero_grad()
    _backward_a_then_b(side)
    side.step(side.opt_a)
    side.step(side.opt_b)


def _iter_ab_step_ba(side, step):
    """(a) backward A, backward B, step B, step A."""
    side.zero_grad()
    _backward_a_then_b(side)
    side.step(side.opt_b)
    side.step(side.opt_a)


def _gan(side, frozen):
    """(b) a GAN: A generates (12 -> 12), B discriminates (the mean of its 5 outputs). B steps on
    real vs detached fakes; then A steps through B: B frozen (requires_grad False), or not
    (B's optimizer then receives grads in A's backward too, dropped by its zero_grad)."""
    g, d = side.a, side.b

    def fake(x):
        return g(x.flip(1) * 0.5)

    side.opt_b.zero_grad()
    side.backward(side.loss(lambda r, x, y: _mse(d(x).mean(1), 1.0) + (d(fake(x).detach()).mean(1) ** 2).mean()))
    side.step(side.opt_b)
    if frozen:
        for p in d.parameters():
            p.requires_grad_(False)
    side.opt_a.zero_grad()
    side.backward(side.loss(lambda r, x, y: _mse(d(fake(x)).mean(1), 1.0)))
    side.step(side.opt_a)
    if frozen:
        for p in d.parameters():
            p.requires_grad_(True)


def _iter_gan_frozen(side, step):
    _gan(side, frozen=True)


def _iter_gan_not_frozen(side, step):
    _gan(side, frozen=False)


def _iter_no_sync(side, step):
    """(c) gradient accumulation: a first micro-batch under no_sync of both (backward A, backward
    B), a second that reduces, then both steps."""
    side.zero_grad()
    with side.no_sync():
        side.backward(_loss_a(side))
        side.backward(side.loss(lambda r, x, y: _mse(side.b(x * 0.5), y)))
    _backward_a_then_b(side)
    side.step(side.opt_a)
    side.step(side.opt_b)


def _both(side, step, r, x, y, skip=lambda step, r: ()):
    """One loss through BOTH models, the two branches built in another order on every other rank
    (so autograd runs them, and fires the optimizers' hooks, in another order there), with a
    layer of A unused on some ranks: B(x) + A(x) on even ranks, A(x) + B(x) on odd ones."""
    if r % 2 == 0:
        lb = _mse(side.b(x), y)
        return lb + _mse(side.a(x, skip=skip(step, r)), x)
    la = _mse(side.a(x, skip=skip(step, r)), x)
    return la + _mse(side.b(x), y)


def _skip_per_rank(step, r):
    return ("c",) if (step + r) % 3 == 0 else ()


def _iter_shared(side, step):
    """One backward through both models: each optimizer receives grads in the same backward."""
    side.zero_grad()
    side.backward(side.loss(lambda r, x, y: _both(side, step, r, x, y, _skip_per_rank)))
    side.step(side.opt_a)
    side.step(side.opt_b)


def _iter_chain(side, step):
    """One backward through both models in a chain, B(A(x)) (a GAN whose discriminator is not
    frozen, its optimizer stepping too); step B before A."""
    side.zero_grad()
    side.backward(side.loss(lambda r, x, y: _mse(side.b(side.a(x, skip=_skip_per_rank(step, r))), y)))
    side.step(side.opt_b)
    side.step(side.opt_a)


def _iter_chain_reentrant(side, step):
    """One backward through both models, A inside a reentrant checkpoint: B's grads arrive in the
    backward's own graph task, A's in the nested one the checkpoint runs (it joins B's round)."""
    from torch.utils.checkpoint import checkpoint

    side.zero_grad()

    def one(r, x, y):
        x = x.detach().requires_grad_()  # a reentrant checkpoint passes grads only to inputs needing them
        return _mse(side.b(checkpoint(side.a, x, use_reentrant=True)), y)

    side.backward(side.loss(one))
    side.step(side.opt_a)
    side.step(side.opt_b)


def _iter_no_sync_shared(side, step):
    """(c) accumulation over backward passes through both models at once."""
    side.zero_grad()
    with side.no_sync():
        side.backward(side.loss(lambda r, x, y: _both(side, step, r, x * 0.5, y)))
    side.backward(side.loss(lambda r, x, y: _both(side, step, r, x, y)))
    side.step(side.opt_a)
    side.step(side.opt_b)


def _inf_on_last_rank(side, step, r, x):
    """``x``, or at INF_STEP on the last rank a copy holding an inf (the scaler patterns)."""
    if step == INF_STEP and r == side.world - 1:
        x = x.clone()
        x[0, 0] = float("inf")
    return x


def _iter_scaler(side, step):
    """(d) one scaler over both: backward A, backward B (an inf in B's batch of the last rank
    only, at INF_STEP), unscale_ and step each, one update."""
    side.zero_grad()
    side.backward(_loss_a(side))
    side.backward(side.loss(lambda r, x, y: _mse(side.b(_inf_on_last_rank(side, step, r, x)), y)))
    side.step(side.opt_a)
    side.step(side.opt_b)
    side.scaler.update()


def _iter_scaler_shared(side, step):
    """(d) one scaler over one backward through both models (the inf as in _iter_scaler, in B)."""
    side.zero_grad()

    def both(r, x, y):
        return _mse(side.b(_inf_on_last_rank(side, step, r, x)), y) + _mse(side.a(x), x)

    side.backward(side.loss(both))
    side.step(side.opt_b)
    side.step(side.opt_a)
    side.scaler.update()


TWO_PATTERNS = {
    "ab": _iter_ab, "ab_step_ba": _iter_ab_step_ba, "gan_frozen": _iter_gan_frozen,
    "gan_not_frozen": _iter_gan_not_frozen, "no_sync": _iter_no_sync, "shared": _iter_shared,
    "chain": _iter_chain, "chain_reentrant": _iter_chain_reentrant, "no_sync_shared": _iter_no_sync_shared,
    "scaler": _iter_scaler, "scaler_shared": _iter_scaler_shared,
}


def _two_optimizers(rank, world, pattern, steps=TWO_STEPS):
    """Train models A and B with two DistributedFusedAdam over the default group in ``pattern``
    and the same with two torch AdamW on one process; return both sides' params (and scales)
    after every step and this rank's launch log."""
    import copy
    import warnings

    from parity import two_groups
    from shardamp.scaler import ShardedGradScaler

    torch.manual_seed(0)
    a, b = MLP(out=12), MLP()
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    scaled = pattern.startswith("scaler")
    # several param groups each, other hyperparameters in B; TINY buckets: many, uneven shards
    groups_b = two_groups(b)
    groups_b[0]["lr"] = 3e-2
    ref_groups_b = two_groups(ref_b)
    ref_groups_b[0]["lr"] = 3e-2
    opt_a = DistributedFusedAdam(two_groups(a), bucket_cap_mb=TINY)
    opt_b = DistributedFusedAdam(groups_b, bucket_cap_mb=TINY, betas=(0.85, 0.98))
    ropt_a = torch.optim.AdamW(two_groups(ref_a))
    ropt_b = torch.optim.AdamW(ref_groups_b, betas=(0.85, 0.98))
    scaler_kw = dict(init_scale=2.0**12, growth_interval=2)
    ours = _Side(False, world, a, b, opt_a, opt_b, ShardedGradScaler("cpu", **scaler_kw) if scaled else None)
    ref = _Side(True, world, ref_a, ref_b, ropt_a, ropt_b, torch.amp.GradScaler("cpu", **scaler_kw) if scaled else None)
    launches = _Launches(a=opt_a, b=opt_b)
    out = {"ours": [], "ref": [], "scale": [], "ref_scale": []}
    with warnings.catch_warnings():
        # the GAN whose discriminator is not frozen adds its grads after its step, as torch does
        warnings.filterwarnings("ignore", message=".*backward after step.*")
        for step in range(steps):
            launches.mark(("step", step))
            for side in (ours, ref):
                side.data(rank, step)
                TWO_PATTERNS[pattern](side, step)
            out["ours"].append([p.detach().clone() for p in list(a.parameters()) + list(b.parameters())])
            out["ref"].append([p.detach().clone() for p in list(ref_a.parameters()) + list(ref_b.parameters())])
            if scaled:
                out["scale"].append(ours.scaler.get_scale())
                out["ref_scale"].append(ref.scaler.get_scale())
    out["log"], out["during"] = launches.log, launches.during
    out["buckets"] = {"a": [s.bucket.numel for s in opt_a._grad_sync.states],
                      "b": [s.bucket.numel for s in opt_b._grad_sync.states]}
    return out


def case_two_opt_ab(rank, world, **kw):
    return _two_optimizers(rank, world, "ab")


def case_two_opt_ab_step_ba(rank, world, **kw):
    return _two_optimizers(rank, world, "ab_step_ba")


def case_two_opt_gan_frozen(rank, world, **kw):
    return _two_optimizers(rank, world, "gan_frozen")


def case_two_opt_gan_not_frozen(rank, world, **kw):
    return _two_optimizers(rank, world, "gan_not_frozen")


def case_two_opt_no_sync(rank, world, **kw):
    return _two_optimizers(rank, world, "no_sync")


def case_two_opt_shared(rank, world, **kw):
    return _two_optimizers(rank, world, "shared")


def case_two_opt_chain(rank, world, **kw):
    return _two_optimizers(rank, world, "chain")


def case_two_opt_chain_reentrant(rank, world, **kw):
    return _two_optimizers(rank, world, "chain_reentrant")


def case_two_opt_no_sync_shared(rank, world, **kw):
    return _two_optimizers(rank, world, "no_sync_shared")


def case_two_opt_scaler(rank, world, **kw):
    return _two_optimizers(rank, world, "scaler")


def case_two_opt_scaler_shared(rank, world, **kw):
    return _two_optimizers(rank, world, "scaler_shared")


def case_two_opt_threads_refused(rank, world, **kw):
    """Backward passes of two threads at once, over two optimizers of one group: the order of
    their launches would depend on the threads' timing. Forced here on every rank (A's backward
    waits in a hook, its round open, until B's has received grads): both steps raise on every
    rank, naming both optimizers, nothing trains; after zero_grad both train again."""
    import threading

    with _bounded_group(world) as group:
        torch.manual_seed(0)
        a, b = MLP(), MLP()
        opt_a = DistributedFusedAdam(a.parameters(), lr=1e-2, bucket_cap_mb=TINY, process_group=group)
        opt_b = DistributedFusedAdam(b.parameters(), lr=1e-2, bucket_cap_mb=TINY, process_group=group)
        a_open, b_received = threading.Event(), threading.Event()
        waited = []
        hooks = [a.c.weight.register_post_accumulate_grad_hook(lambda p: a_open.set()),  # after A's first grads
                 a.a.weight.register_post_accumulate_grad_hook(lambda p: waited.append(b_received.wait(30))),
                 b.a.weight.register_post_accumulate_grad_hook(lambda p: b_received.set())]  # B's last grad
        thread = threading.Thread(target=_backward, args=(a, rank, world))
        thread.start()
        opened = a_open.wait(30)
        _backward(b, rank, world)
        thread.join(60)
        for h in hooks:
            h.remove()
        before = _params(a) + _params(b)
        t0 = time.monotonic()
        at_step = [_raised(opt_a.step), _raised(opt_b.step)]
        seconds = time.monotonic() - t0
        untouched = all(torch.equal(p, q) for p, q in zip(list(a.parameters()) + list(b.parameters()), before))
        opt_a.zero_grad()
        opt_b.zero_grad()
        after = []
        for model, opt in ((a, opt_a), (b, opt_b)):  # one after the other: fine
            _backward(model, rank, world, step=1)
            after.append(_raised(opt.step))
            opt.zero_grad()
        trained = not all(torch.equal(p, q) for p, q in zip(list(a.parameters()) + list(b.parameters()), before))
        return {"forced": opened and waited == [True] and not thread.is_alive(), "at_step": at_step,
                "seconds": seconds, "untouched": untouched, "after": after, "trained": trained,
                "model": _params(a) + _params(b)}
