// The per-gradient path in C++: a post-hook on each parameter's gradient
// accumulator that stages the gradient into its slot and marks it ready in
// the scheduler, without the GIL. See Note [Gradient path].
#pragma once

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace dcredit {

// Note [Gradient path]
// ~~~~~~~~~~~~~~~~~~~~
// As DDP's reducer does, each parameter's AccumulateGrad node carries a C++
// post-hook. In the steady state (the iteration is open, this tensor's
// last backward pass of the step, a dense gradient of the slot's dtype,
// shape and device) it copies the gradient into its slot
// (pre-scaled), points p.grad at the watched alias of the slot (Note
// [Gradient reads]), records the hand-over in the optimizer's per-tensor
// state (Note [Gradient state]: arrays it shares with Python), and marks the
// tensor ready in the scheduler. Python runs only where it must: to open an
// iteration at its first gradient (the opener; that gradient then takes the
// fast path too), one pass too many, sparse or otherwise unusual gradients;
// there the hook calls the optimizer's Python method, which does the same
// work with every check. The passes before a step's last
// (backward_passes_per_step > 1) are only counted, in C++: autograd adds
// each one to p.grad, and the last pass hands over the sum.
//
// Before autograd adds a gradient to p.grad, a C++ tensor pre-hook on the
// parameter checks the two refusals that must come first (the parameter's
// update is still pending: a stale read; more backward passes than
// backward_passes_per_step): where either may apply it calls the Python
// check, which raises. A tensor hook lives on the parameter, not on its
// accumulator, so it also sees the gradients of an accumulator that a stale
// graph read made. Python empties a tensor's hook list when a script
// registers its first Python hook on it; the pre-hook marks each gradient it
// sees, so a post-hook that finds its gradient unmarked puts the pre-hook
// back and runs the Python check and hand-over for that gradient (the check
// comes after autograd added it then: a refusal leaves that p.grad changed).
//
// A lazy step makes a pending parameter's next graph use build a new
// accumulator (Note [Graph reads]); once its update is applied, Refresh()
// gives the leaf back the hooked accumulator we hold where no graph built a
// new one (the common case: no allocation), and otherwise puts the hook on
// the accumulator that graphs will use from then on.
//
// The hooks outlive nothing they touch: each holds the shared State, which
// Close() (the optimizer's close, or the Python object's end) marks closed
// under its mutex before the engine, the tensors or the Python callables go;
// a closed hook does nothing.
class GradientPath {
 public:
  struct State;

  // `counts` (int32), `marked`, `used`, `pending` (uint8) and `versions`
  // (int64) are the optimizer's per-tensor arrays (Python buffers kept alive
  // by the caller until Close()). `slow(i)` runs the Python path for tensor i
  // (with the GIL); `before(i)` the Python checks before a gradient is added
  // (it raises where one is refused); `failed(i, message)` raises the Python
  // error for a scheduler failure; `opener(i)` opens the iteration at its
  // first gradient, tensor i's (it raises where it may not open).
  GradientPath(std::vector<at::Tensor> params, std::function<void(int32_t)> mark_ready, int32_t* counts,
               uint8_t* marked, uint8_t* used, uint8_t* pending, int64_t* versions, pybind11::object slow,
               pybind11::object before, pybind11::object failed, pybind11::object opener);
  ~GradientPath();

  // The slots and their watched aliases of the current plan.
  void SetSlots(std::vector<at::Tensor> slots, std::vector<at::Tensor> watched);
  void SetOpen(bool open);
  void SetFlushed(bool flushed);
  void SetPassesPerStep(int32_t passes);
  void SetPrescale(double prescale);
  // Hooks on every parameter's current accumulator (creating it where none
  // exists yet); for `indices`, after their updates were applied, the leaf's
  // accumulator back to the hooked one, or the hook onto a new one.
  void Install();
  void Refresh(const std::vector<int64_t>& indices);
  // Hooks off, tensors and callables released; idempotent.
  void Close();
  // Gradients that took the Python path since the last call (a count, for tests and the log).
  int64_t TakeSlowCount();
  // The first parameter whose dtype or device is no longer its slot's (the
  // model was cast or moved after wrapping), or -1.
  int64_t FirstMoved();
  // The first of `indices` whose slot was written since its version was
  // recorded (Note [Lazy step]), or -1.
  int64_t FirstWritten(const std::vector<int64_t>& indices);
  // The tensors whose p.grad is not their slot's watched alias now.
  std::vector<int64_t> NotWatched();
  // Note [Short accumulations] (gradient_path.cc): tensor i's backward pass
  // was counted, not handed over (the Python path's record; the C++ path
  // records its own).
  void NotePass(int32_t i);
  // The first counted tensor whose p.grad is still there but was written or
  // replaced since its last counted pass, or -1.
  int64_t FirstWrittenSincePass();
  // Every parameter's data address, in order (the read guard's table is
  // rebuilt only when one moved).
  std::vector<int64_t> Addresses();
  // (i, false) for the first parameter whose storage another tensor holds
  // too (a view or a detached alias that a NumPy array may keep: Note
  // [Hidden writes] in lazy.py), else (i, true) for the first whose version
  // counter another tensor shares (parameters made as views of one buffer:
  // Note [Shared version counters] in lazy.py), else (-1, false).
  std::pair<int64_t, bool> FirstShared();
  // p.grad = its slot for each of `indices`, so that the wrapped optimizer's
  // step reads the reduced gradients past their watched aliases (Note
  // [Gradient reads]); what p.grad held is kept until ReturnSlots puts it
  // back. One C++ pass instead of two Python assignments per tensor.
  // `watched_only`: only where p.grad is the watched alias now (a tensor the
  // script put in p.grad stays, as the eager step takes it).
  void LendSlots(const std::vector<int64_t>& indices, bool watched_only = false);
  void ReturnSlots();
  // zero_grad(set_to_none=False) while updates wait (Note [Zeroed while
  // pending] in core.py): p.grad = spares[i] for each parameter whose update
  // is pending and whose p.grad is its slot or the slot's watched alias,
  // where spares[i] has the parameter's shape, dtype and device. Returns the
  // pending ones whose spare does not (Python gives them a new one).
  std::vector<int64_t> GiveSpares(const std::vector<at::Tensor>& spares);
  // Note [Graph reads] (gradient_path.cc) for the parameters `indices`: drop
  // their links to their accumulators and record their version counters.
  void ForgetGraphReads(const std::vector<int64_t>& indices);
  // Before an apply of `indices`: (i, false) for the first of them that a
  // live graph made since ForgetGraphReads has read, else (i, true) for the
  // first whose version moved since it was recorded (Note [Unseen parameter
  // writes]), else (-1, false).
  std::pair<int64_t, bool> FirstStale(const std::vector<int64_t>& indices);

 private:
  void HookOnto(int32_t i);

  std::shared_ptr<State> state_;
  // A shared_ptr before torch 2.13, an intrusive_ptr since (see torch_compat.h).
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<NodePtr> accumulators_;
  bool installed_ = false;
  std::vector<uintptr_t> keys_;
  std::vector<std::pair<int64_t, at::Tensor>> lent_;  // LendSlots: each tensor's p.grad before
  pybind11::object slow_;
  pybind11::object before_;
  pybind11::object failed_;
  pybind11::object opener_;
};

}  // namespace dcredit
