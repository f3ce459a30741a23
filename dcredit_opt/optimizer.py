"""The drop-in wrapper: hooks, the lazy step, synchronize.

Note [Lazy step]
----------------
With phase 2 on, ``step()`` flushes the scheduler and returns at once: the
remaining blocks are still travelling, highest priority (nearest the input)
first. The update of each parameter is applied later, on the main thread,
just before the first forward of a module that owns it (a global module
forward pre-hook, installed only while updates are pending), by running the
wrapped optimizer's own ``step()`` on that parameter, with the
hyperparameters that were in force when ``step()`` was called. The same
wrapped step also applies every update whose reduction has already finished,
taken from the head of the plan's priority order (the order the blocks
travel in): one wrapped step per module would cost a model of many small
modules more than the transfer it hides. Optimizer
state therefore stays exactly what a synchronous step would have made.
Everything else that could observe a parameter first applies what is
pending: ``synchronize()``, ``state_dict()``/``load_state_dict()`` of the
optimizer and of every module that owns a parameter, and the next backward.
What cannot be seen is a direct read of ``p.data`` outside any forward
between ``step()`` and the next forward; ``synchronize()`` is the cure.

Gradients live in flat buffers owned here (one per dtype, laid out by the
plan); after its hook, ``p.grad`` is a view of its slot, so a finished
reduction is visible in ``p.grad`` with no copy.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import warnings
import weakref

import torch

from . import backends, checks, devices, profiler, runtime, timeline
from .config import Config
from .errors import DCreditError
from .layout import build_layout, fixed_plan
from .planner.plan import Plan, validate

log = logging.getLogger("dcredit_opt")


class ReduceOp(enum.Enum):
    AVERAGE = "average"
    SUM = "sum"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM


def DistributedOptimizer(optimizer, named_parameters=None, backward_passes_per_step: int = 1,
                         op: ReduceOp = Average, gradient_predivide_factor: float = 1.0,
                         config: Config | None = None, sparse_as_dense: bool = False):
    """Wrap ``optimizer`` so that its gradients are averaged across ranks.

    Same names and meaning as ``horovod.torch.DistributedOptimizer``. The
    returned object is an instance of a subclass of ``optimizer``'s class that
    shares its parameter groups and state, so LR schedulers and
    ``isinstance`` checks keep working.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(  # noqa: TRY004 - a supported type is a question of value here
            "torch.optim.LBFGS is not supported: it re-evaluates the closure inside step()")
    if getattr(optimizer, "_dc_names", None) is not None:
        raise ValueError("optimizer is already a dcredit_opt.DistributedOptimizer")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    if op not in (Average, Sum):
        raise ValueError(f"op must be dcredit_opt.Average or dcredit_opt.Sum, got {op!r}")
    if not (isinstance(gradient_predivide_factor, (int, float)) and gradient_predivide_factor > 0):
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if config is None:
        config = Config.from_env()
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a dcredit_opt.Config, got {type(config).__name__}")
    config.validate()
    names, params = checks.named_tracked_params(optimizer, named_parameters)
    _check_devices(names, params)

    base = optimizer.__class__
    body = {k: v for k, v in _DistributedOptimizer.__dict__.items() if k not in ("__dict__", "__weakref__")}
    body["_dc_base"] = base
    cls = type(base.__name__, (base,), body)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._dc_setup(names, params, backward_passes_per_step, op, float(gradient_predivide_factor), config,
                      sparse_as_dense)
    return wrapped


def _check_devices(names, params):
    devices.device_of(names, params)  # one device, CPU or CUDA; the rest after runtime.init()


class _DistributedOptimizer:
    """Body of the generated subclass; see :func:`DistributedOptimizer`."""

    # ---- set-up ---------------------------------------------------------

    def _dc_setup(self, names, params, bpps, op, predivide, config, sparse_as_dense):
        runtime.init(timeout_s=config.timeout_s, backend=config.backend)
        devices.check_world(names, params, config.backend)  # before any collective
        self._dc_config = config
        self._dc_names = names
        self._dc_params = params
        self._dc_index = {id(p): i for i, p in enumerate(params)}
        self._dc_bpps = bpps
        self._dc_sparse_as_dense = sparse_as_dense
        world = runtime.size()
        self._dc_prescale = 1.0 / predivide if op == Average else 1.0
        self._dc_postscale = predivide / world if op == Average else 1.0
        self._dc_group_of = []
        for p in params:
            self._dc_group_of.append(next(gi for gi, g in enumerate(self.param_groups)
                                          if any(q is p for q in g["params"])))
        checks.check_same_model_on_all_ranks(names, params)
        checks.check_same_setup_on_all_ranks(config, backward_passes_per_step=bpps, op=op.value,
                                              gradient_predivide_factor=predivide,
                                              sparse_as_dense=sparse_as_dense)
        T = len(params)
        self._dc_counts = [0] * T
        self._dc_marked = [False] * T
        self._dc_pending = [False] * T
        self._dc_npending = 0
        self._dc_queue_pos = 0  # lazy step: tensors before it in _dc_priority_order are applied
        self._dc_open = False
        self._dc_flushed = False
        self._dc_synchronized = False
        self._dc_skip = False
        self._dc_snapshot = None
        self._dc_steps = 0
        self._dc_module_params = weakref.WeakKeyDictionary()
        self._dc_hooked_modules = weakref.WeakSet()
        self._dc_forward_hook = None
        self._dc_discovering = True
        self._dc_forward_seen = False
        self._dc_backend = backends.create(config.backend, config.channels, config.timeout_s)
        self._dc_engine = self._dc_backend.engine
        self._dc_plan = None
        self._dc_staged_plan = None
        self._dc_profile = None
        self._dc_recorder = (profiler.Recorder(names, params, config.profile_iters)
                             if config.policy != "fixed" and config.profile_iters > 0 and params else None)
        self._dc_timeline = (timeline.RankTimeline(config.timeline_path, runtime.rank(), runtime.size())
                             if config.timeline_path else None)
        self._dc_iteration = 0
        self._dc_set_plan(fixed_plan(
            [p.numel() for p in params], [p.element_size() for p in params], config.block_bytes,
            config.window, config.channels, config.credit_bytes, config.overlap_forward))
        me = weakref.ref(self)
        atexit.register(_drain_at_exit, me)
        runtime.register_user(self)
        self._dc_grad_hooks = [p.register_post_accumulate_grad_hook(_weak_grad_hook(me, i))
                               for i, p in enumerate(params)]
        # A gradient beyond backward_passes_per_step is refused before autograd
        # adds it to p.grad, which by then is our slot, possibly on the wire.
        with torch.enable_grad():
            self._dc_accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
        self._dc_grad_hooks += [p.register_hook(_weak_count_hook(me, i)) for i, p in enumerate(params)]
        self._dc_install_forward_hook()

    def _dc_set_plan(self, plan: Plan) -> None:
        """Switch to ``plan``; only between iterations (nothing in flight)."""
        params = self._dc_params
        validate(plan, numels=[p.numel() for p in params], max_channels=self._dc_config.channels,
                 dtypes=[p.dtype for p in params])
        layout = build_layout(plan, [str(p.dtype) for p in params], [p.element_size() for p in params])
        device = params[0].device if params else torch.device("cpu")
        dtype_of = {str(p.dtype): p.dtype for p in params}
        buffers = [torch.zeros(n, dtype=dtype_of[k], device=device)
                   for k, n in zip(layout.segment_keys, layout.segment_numels)]
        slots = [buffers[layout.tensor_segment[i]].narrow(0, layout.tensor_offset[i], p.numel()).view(p.shape)
                 for i, p in enumerate(params)]
        self._dc_engine.set_plan(
            plan.num_tensors, list(plan.order), list(layout.block_segment), list(layout.block_offset),
            list(layout.block_numel), list(layout.block_bytes), list(layout.block_priority),
            [list(t) for t in layout.block_tensors], list(plan.phase1_windows or [-1] * plan.num_tensors),
            list(plan.phase2_windows), plan.credit_bytes, plan.channels,
            self._dc_backend.buffers_for_engine(buffers), self._dc_postscale)
        self._dc_backend.set_blocks(buffers, layout, self._dc_postscale)
        self._dc_plan, self._dc_layout, self._dc_buffers, self._dc_slots = plan, layout, buffers, slots
        self._dc_priority_order = sorted(range(plan.num_tensors), key=plan.tensor_priority)

    # ---- backward: hooks ------------------------------------------------

    def _dc_too_many_passes(self, i: int) -> DCreditError:
        return DCreditError(
            f"gradient of parameter '{self._dc_names[i]}' was computed {self._dc_counts[i] + 1} times before "
            f"step(), but backward_passes_per_step={self._dc_bpps}. Call step() after every "
            f"{self._dc_bpps} backward pass(es), or raise backward_passes_per_step.")

    def _dc_before_accumulate(self, i: int) -> None:
        """Tensor hook: runs before autograd adds a gradient to ``p.grad``, so a refusal changes nothing."""
        if self._dc_counts[i] >= self._dc_bpps and _will_accumulate(self._dc_accumulators[i]):
            raise self._dc_too_many_passes(i)

    def _dc_on_grad(self, i: int, p: torch.Tensor) -> None:
        count = self._dc_counts[i] + 1
        if count > self._dc_bpps:
            raise self._dc_too_many_passes(i)
        self._dc_counts[i] = count
        if count < self._dc_bpps:
            return
        if not self._dc_open:
            self._dc_begin()
        self._dc_stage(i, p)
        self._dc_marked[i] = True
        try:
            self._dc_engine.mark_ready(i)
        except (RuntimeError, TimeoutError) as e:
            raise _where(e, f"phase 1 (backward), at the gradient of '{self._dc_names[i]}' (tensor {i})") from e

    def _dc_begin(self) -> None:
        if self._dc_npending:
            self._dc_apply(range(len(self._dc_params)))  # parameters no forward used
        if self._dc_timeline is not None and self._dc_iteration:
            self._dc_timeline.record(self._dc_engine.trace(), self._dc_engine.ready_times(), self._dc_names,
                                     self._dc_layout.block_tensors, self._dc_iteration)
        if self._dc_staged_plan is not None:
            # Every rank stages the same plan at the same step(), so every
            # rank switches here, in the same iteration.
            plan, self._dc_staged_plan = self._dc_staged_plan, None
            self._dc_set_plan(plan)
        self._dc_iteration += 1
        try:
            self._dc_engine.start_iteration()
        except (RuntimeError, TimeoutError) as e:
            raise _where(e, "phase 1 (start of backward)") from e
        self._dc_open = True
        self._dc_flushed = False
        self._dc_synchronized = False
        self._dc_marked = [False] * len(self._dc_params)

    def _dc_stage(self, i: int, p: torch.Tensor) -> None:
        """Put this rank's gradient of tensor ``i`` into its slot (pre-scaled) and alias ``p.grad``."""
        slot = self._dc_slots[i]
        g = p.grad
        if g is None:
            slot.zero_()  # unused on this rank: contribute zeros, as Horovod does
        elif _is_view_of(g, slot):
            if self._dc_prescale != 1.0:
                slot.mul_(self._dc_prescale)
            return
        else:
            if g.is_sparse:
                if not self._dc_sparse_as_dense:
                    raise DCreditError(
                        f"parameter '{self._dc_names[i]}' has a sparse gradient; pass sparse_as_dense=True "
                        "to DistributedOptimizer to reduce it as a dense tensor")
                g = g.to_dense()
            if self._dc_prescale != 1.0:
                torch.mul(g, self._dc_prescale, out=slot)
            else:
                slot.copy_(g)
        p.grad = slot

    def _dc_flush(self) -> None:
        """End of backward: unmarked tensors (unused here) join with what they have."""
        for i, p in enumerate(self._dc_params):
            if not self._dc_marked[i]:
                self._dc_stage(i, p)
                self._dc_marked[i] = True
        try:
            self._dc_engine.flush()
        except (RuntimeError, TimeoutError) as e:
            raise _where(e, "end of phase 1 (the flush in step() or synchronize())") from e
        self._dc_flushed = True

    # ---- the public optimizer API ----------------------------------------

    def synchronize(self) -> None:
        """Finish reducing this iteration's gradients (and apply any pending update)."""
        if self._dc_npending:
            self._dc_apply(range(len(self._dc_params)))
        if self._dc_open and not self._dc_synchronized:
            if not self._dc_flushed:
                self._dc_flush()
            try:
                self._dc_engine.wait_all(float(self._dc_config.timeout_s))
            except (RuntimeError, TimeoutError) as e:
                raise _where(e, "synchronize(), waiting for every block") from e
            self._dc_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use after ``synchronize()``: ``step()`` then does not synchronize again."""
        self._dc_skip = True
        try:
            yield
        finally:
            self._dc_skip = False

    def step(self, closure=None):
        if getattr(self, "_dc_closed", False):
            raise DCreditError("this DistributedOptimizer was closed (dc.shutdown() closes every one): its hooks "
                               "and channels are gone; build a new DistributedOptimizer after dc.init()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._dc_synchronized and not self._dc_skip:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to "
                          "consider using optimizer.skip_synchronize() context if you use "
                          "optimizer.synchronize() in your code.")
        if not self._dc_open:
            if not any(self._dc_counts):
                raise DCreditError("step() called, but no gradient was computed since the last step(): "
                                   "call loss.backward() before optimizer.step()")
            self._dc_begin()  # fewer backward passes than backward_passes_per_step: reduce what there is
        if not self._dc_flushed:
            self._dc_flush()
        if self._dc_config.check_finite:
            self._dc_check_finite()
        self._dc_snapshot = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        self._dc_counts = [0] * len(self._dc_params)
        self._dc_open = False
        self._dc_pending = [True] * len(self._dc_params)
        self._dc_npending = len(self._dc_params)
        self._dc_steps += 1
        if self._dc_steps >= 2:
            self._dc_discovering = False
        # Until a forward has been seen, the modules to hook are unknown: apply
        # now. While profiling, too: a forward must not include waiting.
        lazy = (self._dc_plan.overlap_forward and self._dc_config.overlap_forward and self._dc_forward_seen
                and not self._dc_synchronized and self._dc_recorder is None)
        self._dc_synchronized = False
        if lazy:
            self._dc_queue_pos = 0
            self._dc_install_forward_hook()
        else:
            self._dc_apply(range(len(self._dc_params)))
        if self._dc_recorder is not None:
            self._dc_recorder.on_step(self._dc_engine.ready_times())
            if self._dc_recorder.done:
                self._dc_finish_profiling()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._dc_open and any(self._dc_marked) and not self._dc_synchronized:
            raise DCreditError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(): the gradients are being reduced")
        for i, p in enumerate(self._dc_params):
            if self._dc_pending[i] and _is_view_of(p.grad, self._dc_slots[i]):
                # The slot holds the reduced gradient a pending update still needs.
                p.grad = None if set_to_none else torch.zeros_like(p)
        self._dc_base.zero_grad(self, set_to_none=set_to_none)

    def state_dict(self):
        self._dc_apply_pending()
        return self._dc_base.state_dict(self)

    def load_state_dict(self, state_dict):
        self._dc_apply_pending()
        return self._dc_base.load_state_dict(self, state_dict)

    def add_param_group(self, param_group):
        raise ValueError("add_param_group() on a DistributedOptimizer is not supported: add the group to the "
                         "wrapped optimizer before calling dcredit_opt.DistributedOptimizer")

    def _dc_check_finite(self) -> None:
        """Config.check_finite: wait for every block; on NaN or Inf refuse the whole step.

        The check comes before any update, so a refused step changes no
        parameter and no optimizer state (a lazy check at each layer's forward
        would have updated the layers before it). Every rank sees the same
        reduced values, so every rank refuses the same step.
        """
        try:
            self._dc_engine.wait_all(float(self._dc_config.timeout_s))
        except (RuntimeError, TimeoutError) as e:
            raise _where(e, "step(), waiting for every block (Config.check_finite)") from e
        if all(bool(torch.isfinite(b).all()) for b in self._dc_buffers):
            return
        bad = next(i for i, slot in enumerate(self._dc_slots) if not bool(torch.isfinite(slot).all()))
        self._dc_counts = [0] * len(self._dc_params)
        self._dc_open = False
        raise DCreditError(f"the reduced gradient of '{self._dc_names[bad]}' holds NaN or Inf (Config.check_finite "
                           "is on): step() skipped, no parameter or optimizer state was changed; the reduced "
                           "gradients stay in p.grad")

    # ---- phase 2: applying updates ----------------------------------------

    def _dc_apply_pending(self) -> None:
        if self._dc_npending:
            self._dc_apply(range(len(self._dc_params)))

    def _dc_apply(self, indices) -> None:
        """Wait for tensors ``indices`` and run the wrapped step on those still pending."""
        todo = [i for i in dict.fromkeys(indices) if self._dc_pending[i]]
        if not todo:
            return
        timeout = float(self._dc_config.timeout_s)
        for i in todo:
            try:
                self._dc_engine.wait_tensor(i, timeout)
            except (RuntimeError, TimeoutError) as e:
                raise _where(e, f"phase 2 (after step()), waiting for the reduced gradient of "
                                f"'{self._dc_names[i]}' (tensor {i}) to apply its update") from e
        params, slots = self._dc_params, self._dc_slots
        groups = self.param_groups
        saved_params = [g["params"] for g in groups]
        saved_hyper = [{k: g[k] for k in snap} for g, snap in zip(groups, self._dc_snapshot)]
        saved_grads = [params[i].grad for i in todo]
        members = [[] for _ in groups]
        for i in todo:
            members[self._dc_group_of[i]].append(params[i])
        try:
            for g, m, snap in zip(groups, members, self._dc_snapshot):
                g["params"] = m
                g.update(snap)
            for i in todo:
                params[i].grad = slots[i]
            self._dc_base.step(self)
        finally:
            for g, ps, hyper in zip(groups, saved_params, saved_hyper):
                g["params"] = ps
                g.update(hyper)
            for i, grad in zip(todo, saved_grads):
                params[i].grad = grad
        for i in todo:
            self._dc_pending[i] = False
        self._dc_npending -= len(todo)
        if not self._dc_npending and not self._dc_discovering and self._dc_recorder is None:
            self._dc_remove_forward_hook()

    def _dc_install_forward_hook(self) -> None:
        if self._dc_forward_hook is None:
            self._dc_forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(
                _weak_forward_hook(weakref.ref(self)))

    def _dc_remove_forward_hook(self) -> None:
        if self._dc_forward_hook is not None:
            self._dc_forward_hook.remove()
            self._dc_forward_hook = None

    def _dc_before_forward(self, module: torch.nn.Module) -> None:
        self._dc_forward_seen = True
        own = self._dc_module_params.get(module)
        if own is None:
            own = tuple(self._dc_index[id(p)] for p in module._parameters.values()
                        if p is not None and id(p) in self._dc_index)
            self._dc_module_params[module] = own
            if own and module not in self._dc_hooked_modules:
                # model.state_dict()/load_state_dict() must see applied updates.
                me = weakref.ref(self)
                module.register_state_dict_pre_hook(_weak_apply_hook(me))
                module.register_load_state_dict_pre_hook(_weak_apply_hook(me))
                self._dc_hooked_modules.add(module)
        if own and self._dc_recorder is not None:
            self._dc_recorder.on_forward(own)
        if own and self._dc_npending:
            self._dc_apply(own + self._dc_finished())

    def _dc_finished(self) -> tuple[int, ...]:
        """Pending tensors at the head of the priority order whose reduction has finished."""
        queue, k, done = self._dc_priority_order, self._dc_queue_pos, []
        while k < len(queue):
            i = queue[k]
            if self._dc_pending[i]:
                if not self._dc_engine.tensor_done(i):
                    break
                done.append(i)
            k += 1
        self._dc_queue_pos = k
        return tuple(done)

    # ---- profiling, planning, timeline ---------------------------------------

    def _dc_finish_profiling(self) -> None:
        """Every rank: measure the network; rank 0: plan; everyone: stage rank 0's plan."""
        recorder, self._dc_recorder = self._dc_recorder, None
        if not self._dc_npending:
            self._dc_remove_forward_hook()
        alpha, beta, _ = self._dc_backend.measure_alpha_beta(self._dc_params[0].device)
        self._dc_staged_plan, self._dc_profile = profiler.agree_on_plan(recorder, alpha, beta, self._dc_config,
                                                                        self._dc_params)

    @property
    def plan(self) -> Plan:
        """The plan in force (the staged one, once profiling has produced it)."""
        return self._dc_staged_plan or self._dc_plan

    @property
    def profile(self):
        """What profiling measured (rank 0 only; None elsewhere or before)."""
        return self._dc_profile

    def _dc_drain(self) -> None:
        """Let this iteration's blocks finish before this process stops talking.

        After a lazy ``step()`` the last blocks are still travelling; a rank
        that exits then would leave its peers waiting on collectives it never
        joins (they would fail with "connection closed by peer"). Bounded by
        the timeout; a failure here is only logged, the job is ending anyway.
        """
        try:
            if self._dc_flushed or self._dc_npending:
                self._dc_engine.wait_all(float(self._dc_config.timeout_s))
        except (RuntimeError, TimeoutError) as e:
            log.warning("dcredit_opt: gradients still in flight at exit did not finish: %s", e)

    def _dc_close(self) -> None:
        """Detach from the model: hooks removed, engine shut down. Idempotent."""
        if getattr(self, "_dc_closed", False):
            return
        self._dc_closed = True
        self._dc_drain()
        self._dc_remove_forward_hook()
        for h in self._dc_grad_hooks:
            h.remove()
        self._dc_grad_hooks = []
        self._dc_backend.close()


def _drain_at_exit(ref) -> None:
    opt = ref()
    if opt is not None and not getattr(opt, "_dc_closed", False):
        opt._dc_drain()


def _where(e: Exception, where: str) -> Exception:
    """Engine error ``e`` again, same type, saying which rank saw it and where."""
    return type(e)(f"rank {runtime.rank()} of {runtime.size()}, {where}: {e}")


def _is_view_of(grad, slot) -> bool:
    """``grad`` is ``slot`` (our buffer), so the reduction already lands in it."""
    return (grad is not None and not grad.is_sparse and slot.numel() > 0
            and grad.data_ptr() == slot.data_ptr() and grad.shape == slot.shape)


def _weak_grad_hook(ref, i):
    def hook(p):
        opt = ref()
        if opt is not None:
            opt._dc_on_grad(i, p)
    return hook


def _weak_count_hook(ref, i):
    def hook(grad):
        opt = ref()
        if opt is not None:
            opt._dc_before_accumulate(i)
    return hook


def _will_accumulate(accumulator) -> bool:
    """Whether the running backward adds to ``p.grad`` (``torch.autograd.grad()`` does not)."""
    try:
        return bool(torch._C._will_engine_execute_node(accumulator))
    except RuntimeError:
        return False  # torch.autograd.grad(): the gradient is returned, p.grad is left alone
    except AttributeError:
        return True  # a torch without this query: assume backward()


def _weak_forward_hook(ref):
    def hook(module, args):
        opt = ref()
        if opt is not None:
            opt._dc_before_forward(module)
    return hook


def _weak_apply_hook(ref):
    def hook(module, *args, **kwargs):
        opt = ref()
        if opt is not None:
            opt._dc_apply_pending()
    return hook


