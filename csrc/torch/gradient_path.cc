// See Note [Gradient path] in gradient_path.h.
#include "gradient_path.h"

#include "torch_compat.h"

#include <torch/csrc/Exceptions.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <string>
#include <unordered_map>
#include <utility>

namespace dcredit {

struct GradientPath::State : std::enable_shared_from_this<GradientPath::State> {
  std::mutex mu;
  bool closed = false;
  bool open = false;
  bool flushed = false;
  int32_t passes = 1;
  double prescale = 1.0;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> slots;
  std::vector<at::Tensor> watched;
  std::function<void(int32_t)> mark_ready;
  int32_t* counts = nullptr;
  uint8_t* marked = nullptr;
  uint8_t* used = nullptr;
  uint8_t* pending = nullptr;
  int64_t* versions = nullptr;
  PyObject* slow = nullptr;    // borrowed: GradientPath holds the reference until Close()
  PyObject* before = nullptr;  // idem
  PyObject* failed = nullptr;  // idem
  PyObject* opener = nullptr;  // idem
  std::atomic<int64_t> slow_count{0};
  // Per tensor: the pre-hook saw a gradient that the post-hook has not taken yet.
  std::vector<uint8_t> pre_seen;
  // Per parameter: its version counter when ForgetGraphReads last saw it (Note [Unseen parameter writes]).
  std::vector<int64_t> param_versions;
  // Per tensor: p.grad (weakly: its memory is not kept) and its version at its last counted backward pass
  // (Note [Short accumulations]).
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> pass_grads;
  std::vector<int64_t> pass_versions;

  // Runs on autograd's thread before tensor i's gradient (`incoming`) is
  // added to p.grad; the GIL is not held. Python only where a refusal may
  // apply, or where a sparse gradient is about to be added to a dense p.grad
  // (Note [Sparse gradients] in sparse.py: ours becomes sparse first).
  void BeforeGradient(int32_t i, const at::Tensor* incoming) {
    std::unique_lock<std::mutex> lock(mu);
    if (closed) return;
    pre_seen[i] = 1;
    // After the flush (synchronize(), a read that waited, step() opening a short accumulation) a gradient
    // would never be reduced: Python refuses it.
    if (!pending[i] && counts[i] < passes && !(open && flushed) && !SparseOntoDense(i, incoming)) return;
    lock.unlock();
    CallPython(before, i, nullptr);
  }

  bool SparseOntoDense(int32_t i, const at::Tensor* incoming) const {
    if (incoming == nullptr || !incoming->defined() || !incoming->is_sparse()) return false;
    const at::Tensor& grad = params[i].grad();
    return grad.defined() && !grad.is_sparse();
  }

  // Tensor i's pre-hook, on the parameter (see the class comment).
  void AddPreHook(int32_t i);

  // Runs on autograd's thread for tensor i's accumulator, after it has added
  // the gradient to p.grad; the GIL is not held.
  void OnGradient(int32_t i) {
    std::unique_lock<std::mutex> lock(mu);
    if (closed) return;
    const bool checked = pre_seen[i] != 0;
    pre_seen[i] = 0;
    if (!checked) {
      // A Python hook registered since emptied the parameter's hook list: the pre-hook goes back, and
      // this gradient gets its checks (after autograd added it) and the Python path.
      AddPreHook(i);
      slow_count.fetch_add(1, std::memory_order_relaxed);
      lock.unlock();
      CallPython(before, i, nullptr);
      CallPython(slow, i, nullptr);
      return;
    }
    if (counts[i] < passes - 1) {
      // A backward pass before the last of the step (backward_passes_per_step): autograd keeps this one's
      // gradient in p.grad, where the next pass adds to it; it is only counted (the pre-hook refused it where
      // its update was pending).
      counts[i] += 1;
      NotePass(i);
      return;
    }
    const bool last_pass = counts[i] == passes - 1;  // else one pass too many: Python raises
    if (!open && last_pass) {
      // The iteration's first gradient: Python opens it (with its checks; it raises where the iteration may
      // not open), then this gradient takes the fast path like every other.
      lock.unlock();
      CallPython(opener, i, nullptr);
      lock.lock();
      if (closed) return;
    }
    // The last pass's test again, not `last_pass`: the opener ran without the lock.
    if (!(open && !flushed && counts[i] == passes - 1) || !Stage(i)) {
      slow_count.fetch_add(1, std::memory_order_relaxed);
      lock.unlock();
      CallPython(slow, i, nullptr);
      return;
    }
    marked[i] = 1;
    counts[i] = passes;
    try {
      mark_ready(i);
    } catch (const std::exception& e) {
      const std::string message = e.what();
      lock.unlock();
      CallPython(failed, i, &message);
    }
  }

  // Note [Short accumulations]: what p.grad is after tensor i's counted pass. The lock is held.
  void NotePass(int32_t i) {
    const at::Tensor& grad = params[i].grad();
    if (grad.defined()) {
      pass_grads[i] = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(grad.getIntrusivePtr());
      pass_versions[i] = grad._version();
    } else {
      pass_grads[i].reset();
    }
  }

  // The fast path's hand-over of tensor i's gradient into its slot; false
  // (nothing changed) where the Python path must do it.
  bool Stage(int32_t i) {
    at::Tensor& grad = params[i].mutable_grad();
    const at::Tensor& slot = slots[i];
    const at::Tensor& alias = watched[i];
    if (!grad.defined() || slot.numel() == 0) return false;
    if (grad.unsafeGetTensorImpl() == alias.unsafeGetTensorImpl()) {
      if (prescale != 1.0) slot.mul_(prescale);
    } else {
      // A gradient with a graph (create_graph=True) is refused by the Python path (Note [Gradients with a
      // graph] in gradients.py).
      if (grad.is_sparse() || grad.requires_grad() || grad.scalar_type() != slot.scalar_type() ||
          grad.device() != slot.device() || !grad.sizes().equals(slot.sizes())) {
        return false;
      }
      const bool aliases = grad.data_ptr() == slot.data_ptr();
      if (prescale != 1.0) {
        if (aliases) {
          slot.mul_(prescale);
        } else {
          at::mul_out(const_cast<at::Tensor&>(slot), grad, prescale);
        }
      } else if (!aliases) {
        CopyInto(slot, grad);
      }
      grad = alias;  // Note [Gradient reads]
    }
    used[i] = 1;
    versions[i] = slot._version();  // from here on, only the collectives write the blocks
    return true;
  }

  // slot = grad, of the same dtype and shape. Two contiguous strided CPU tensors: one memcpy, without the
  // dispatcher's and TensorIterator's set-up, which cost more than the copy for the many small gradients of
  // a model; the slot's version moves as copy_ moves it (a graph that saved the slot still sees the write).
  // Otherwise torch's copy_.
  static void CopyInto(const at::Tensor& slot, const at::Tensor& grad) {
    if (slot.device().is_cpu() && grad.device().is_cpu() && slot.layout() == at::kStrided &&
        grad.layout() == at::kStrided && !grad.is_quantized() && slot.is_contiguous() && grad.is_contiguous() &&
        !grad.is_conj() && !grad.is_neg()) {
      std::memcpy(slot.data_ptr(), grad.data_ptr(), grad.nbytes());
      torch::autograd::impl::bump_version(slot);
      return;
    }
    const_cast<at::Tensor&>(slot).copy_(grad);
  }

  // Calls `fn(i)` or `fn(i, message)` with the GIL; a Python exception goes
  // on as itself (a DCreditError stays one through autograd).
  static void CallPython(PyObject* fn, int32_t i, const std::string* message) {
    pybind11::gil_scoped_acquire gil;
    if (fn == nullptr) return;
    try {
      pybind11::handle f(fn);
      if (message == nullptr) {
        f(i);
      } else {
        f(i, *message);
      }
    } catch (pybind11::error_already_set& e) {
      e.restore();
      python_error error;
      error.persist();  // the Python exception itself, so that autograd re-raises it as it is
      throw error;
    }
  }
};

namespace {

// Throws std::out_of_range (IndexError in Python) naming `call` unless 0 <= i < n.
void CheckIndex(size_t n, int64_t i, const char* call) {
  if (i < 0 || i >= static_cast<int64_t>(n)) {
    throw std::out_of_range(std::string(call) + ": tensor " + std::to_string(i) + " out of range");
  }
}

class PreHook : public torch::autograd::FunctionPreHook {
 public:
  PreHook(std::shared_ptr<GradientPath::State> state, int32_t index) : state_(std::move(state)), index_(index) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& values) override {
    state_->BeforeGradient(index_, values.empty() ? nullptr : &values[0]);
    return values;
  }

  bool Of(const GradientPath::State* state) const { return state_.get() == state; }

 private:
  std::shared_ptr<GradientPath::State> state_;
  int32_t index_;
};

class PostHook : public torch::autograd::FunctionPostHook {
 public:
  PostHook(std::shared_ptr<GradientPath::State> state, int32_t index) : state_(std::move(state)), index_(index) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    state_->OnGradient(index_);
    return outputs;
  }

 private:
  std::shared_ptr<GradientPath::State> state_;
  int32_t index_;
};

}  // namespace

void GradientPath::State::AddPreHook(int32_t i) {
  // Appended to the parameter's own list, after any Python hook (impl::add_hook wants the list empty).
  torch::autograd::impl::materialize_autograd_meta(params[i])->hooks_.push_back(
      std::make_unique<PreHook>(shared_from_this(), i));
}

GradientPath::GradientPath(std::vector<at::Tensor> params, std::function<void(int32_t)> mark_ready,
                           int32_t* counts, uint8_t* marked, uint8_t* used, uint8_t* pending, int64_t* versions,
                           pybind11::object slow, pybind11::object before, pybind11::object failed,
                           pybind11::object opener)
    : state_(std::make_shared<State>()),
      slow_(std::move(slow)),
      before_(std::move(before)),
      failed_(std::move(failed)),
      opener_(std::move(opener)) {
  State& s = *state_;
  s.params = std::move(params);
  s.mark_ready = std::move(mark_ready);
  s.counts = counts;
  s.marked = marked;
  s.used = used;
  s.pending = pending;
  s.versions = versions;
  s.slow = slow_.ptr();
  s.before = before_.ptr();
  s.failed = failed_.ptr();
  s.opener = opener_.ptr();
  s.pre_seen.assign(s.params.size(), 0);
  s.param_versions.assign(s.params.size(), 0);
  s.pass_grads.assign(s.params.size(), c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(
                                          c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()));
  s.pass_versions.assign(s.params.size(), 0);
  accumulators_.resize(s.params.size());
  keys_.resize(s.params.size(), 0);
}

GradientPath::~GradientPath() { Close(); }

void GradientPath::SetSlots(std::vector<at::Tensor> slots, std::vector<at::Tensor> watched) {
  if (slots.size() != state_->params.size() || watched.size() != slots.size()) {
    throw std::invalid_argument("set_slots: one slot and one watched alias per parameter");
  }
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->slots = std::move(slots);
  state_->watched = std::move(watched);
}

void GradientPath::SetOpen(bool open) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->open = open;
}

void GradientPath::SetFlushed(bool flushed) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->flushed = flushed;
}

void GradientPath::SetPassesPerStep(int32_t passes) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->passes = passes;
}

void GradientPath::SetPrescale(double prescale) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->prescale = prescale;
}

void GradientPath::HookOnto(int32_t i) {
  auto acc = torch::autograd::impl::grad_accumulator(state_->params[i]);
  if (!acc || acc.get() == accumulators_[i].get()) return;
  if (accumulators_[i]) accumulators_[i]->del_post_hook(keys_[i]);
  keys_[i] = acc->add_post_hook(std::make_unique<PostHook>(state_, i));
  accumulators_[i] = std::move(acc);
}

void GradientPath::Install() {
  if (state_->closed) throw std::logic_error("install on a closed gradient path");
  if (installed_) throw std::logic_error("install on an installed gradient path");
  installed_ = true;
  for (size_t i = 0; i < state_->params.size(); ++i) {
    state_->AddPreHook(static_cast<int32_t>(i));
    HookOnto(static_cast<int32_t>(i));
  }
}

void GradientPath::Refresh(const std::vector<int64_t>& indices) {
  if (state_->closed) return;
  for (int64_t i : indices) {
    CheckIndex(state_->params.size(), i, "refresh");
    const at::Tensor& p = state_->params[i];
    if (accumulators_[i] && torch::autograd::impl::get_autograd_meta(p) != nullptr &&
        !torch::autograd::impl::try_get_grad_accumulator(p)) {
      // No graph made since ForgetGraphReads read the parameter (Note [Graph reads]): the node we hook, which
      // we hold, is the leaf's again; no new node, no new hook.
      compat::RestoreGradAccumulator(p, accumulators_[i]);
      continue;
    }
    HookOnto(static_cast<int32_t>(i));
  }
}

void GradientPath::Close() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->closed) return;
    state_->closed = true;
    state_->slow = nullptr;
    state_->before = nullptr;
    state_->failed = nullptr;
    state_->opener = nullptr;
    state_->mark_ready = nullptr;
    state_->counts = nullptr;
    state_->marked = nullptr;
    state_->used = nullptr;
    state_->pending = nullptr;
    state_->versions = nullptr;
  }
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    if (accumulators_[i]) accumulators_[i]->del_post_hook(keys_[i]);
  }
  // The pre-hooks, from each parameter's hook list (closed, they would do nothing; gone, they cost nothing).
  for (const at::Tensor& p : state_->params) {
    if (torch::autograd::impl::get_autograd_meta(p) == nullptr) continue;
    auto& hooks = torch::autograd::impl::hooks(p);
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                               [this](const std::unique_ptr<torch::autograd::FunctionPreHook>& h) {
                                 const auto* ours = dynamic_cast<const PreHook*>(h.get());
                                 return ours != nullptr && ours->Of(state_.get());
                               }),
                hooks.end());
  }
  accumulators_.clear();
  std::vector<at::Tensor> params, slots, watched;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    params.swap(state_->params);
    slots.swap(state_->slots);
    watched.swap(state_->watched);
  }
  slow_ = pybind11::object();
  before_ = pybind11::object();
  failed_ = pybind11::object();
  opener_ = pybind11::object();
}

int64_t GradientPath::TakeSlowCount() { return state_->slow_count.exchange(0); }

int64_t GradientPath::FirstMoved() {
  std::lock_guard<std::mutex> lock(state_->mu);
  const State& s = *state_;
  for (size_t i = 0; i < s.params.size() && i < s.slots.size(); ++i) {
    if (s.params[i].scalar_type() != s.slots[i].scalar_type() || s.params[i].device() != s.slots[i].device()) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

int64_t GradientPath::FirstWritten(const std::vector<int64_t>& indices) {
  std::lock_guard<std::mutex> lock(state_->mu);
  const State& s = *state_;
  if (s.closed) return -1;
  for (int64_t i : indices) {
    CheckIndex(s.slots.size(), i, "first_written");
    if (s.slots[i]._version() != s.versions[i]) return i;
  }
  return -1;
}

std::vector<int64_t> GradientPath::NotWatched() {
  std::lock_guard<std::mutex> lock(state_->mu);
  const State& s = *state_;
  std::vector<int64_t> out;
  for (size_t i = 0; i < s.params.size() && i < s.watched.size(); ++i) {
    const at::Tensor& grad = s.params[i].grad();
    if (!grad.defined() || grad.unsafeGetTensorImpl() != s.watched[i].unsafeGetTensorImpl()) {
      out.push_back(static_cast<int64_t>(i));
    }
  }
  return out;
}

// Note [Short accumulations]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With backward_passes_per_step = n, a tensor's gradient is handed over at
// its n-th backward pass; the passes before are only counted, and p.grad is
// this rank's own meanwhile, as in Horovod. A step() after fewer passes (an
// epoch's last, short accumulation) reduces what there is: no iteration
// opened in backward, so step() or synchronize() opens it and flushes. Code
// that changed p.grad before that (clip_grad_norm_, clip_grad_value_, a
// scaler's unscale_) changed this rank's own gradient, and the ranks'
// average of clipped gradients is not the clip of the average: alike on
// every rank, so no check between ranks would see it. Each counted pass
// records p.grad (weakly) and its version; where the iteration opens outside
// backward, a counted tensor whose p.grad is still there but is another
// tensor or moved its version was written in between: refused there,
// naming it and synchronize() (which, called first, makes those reads and
// writes see the average). A p.grad set to None is a dropped gradient, as
// anywhere. A write that moves no version (through `.data`) is not seen; so
// is a write between two counted passes (each rank's own micro-batch
// gradient, as in Horovod).
void GradientPath::NotePass(int32_t i) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->closed) return;
  CheckIndex(state_->params.size(), i, "note_pass");
  state_->NotePass(i);
}

int64_t GradientPath::FirstWrittenSincePass() {
  std::lock_guard<std::mutex> lock(state_->mu);
  const State& s = *state_;
  if (s.closed) return -1;
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (s.counts[i] == 0) continue;
    const at::Tensor& grad = s.params[i].grad();
    if (!grad.defined()) continue;
    auto recorded = s.pass_grads[i].lock();
    if (recorded.get() != grad.unsafeGetTensorImpl() || grad._version() != s.pass_versions[i]) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

std::vector<int64_t> GradientPath::Addresses() {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::vector<int64_t> out;
  out.reserve(state_->params.size());
  for (const at::Tensor& p : state_->params) out.push_back(reinterpret_cast<int64_t>(p.data_ptr()));
  return out;
}

namespace {

// The first parameter whose version counter another tensor shares (Note [Shared version counters] in lazy.py).
std::pair<int64_t, bool> FirstSharedCounter(const std::vector<at::Tensor>& params) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (!torch::autograd::impl::version_counter(params[i]).unique()) return {static_cast<int64_t>(i), true};
  }
  return {-1, false};
}

}  // namespace

std::pair<int64_t, bool> GradientPath::FirstShared() {
  std::lock_guard<std::mutex> lock(state_->mu);
  const State& s = *state_;
  // Parameters laid out over one buffer hold its storage once each; so does
  // the Python storage object torch keeps once `untyped_storage()` was
  // called (torch.save calls it), while no Python code holds it. Any holder
  // beyond these is another tensor. The common case, one holder per storage,
  // needs no count of ours.
  auto others = [](const at::Tensor& p) -> int64_t {
    if (!p.has_storage()) return 0;
    const c10::Storage& storage = p.storage();
    int64_t users = static_cast<int64_t>(storage.use_count()) - 1;
    if (storage.unsafeGetStorageImpl()->pyobj_slot()->has_unique_reference()) --users;
    return users;
  };
  if (std::none_of(s.params.begin(), s.params.end(), [&](const at::Tensor& p) { return others(p) > 0; })) {
    return FirstSharedCounter(s.params);
  }
  std::unordered_map<const c10::StorageImpl*, int64_t> ours;
  for (const at::Tensor& p : s.params) {
    if (p.has_storage()) ++ours[p.storage().unsafeGetStorageImpl()];
  }
  for (size_t i = 0; i < s.params.size(); ++i) {
    const at::Tensor& p = s.params[i];
    if (p.has_storage() && others(p) + 1 > ours[p.storage().unsafeGetStorageImpl()]) {
      return {static_cast<int64_t>(i), false};
    }
  }
  return FirstSharedCounter(s.params);
}

void GradientPath::LendSlots(const std::vector<int64_t>& indices, bool watched_only) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!lent_.empty()) throw std::logic_error("lend_slots: the slots lent before were not returned");
  const State& s = *state_;
  for (int64_t i : indices) CheckIndex(s.slots.size(), i, "lend_slots");
  lent_.reserve(indices.size());
  for (int64_t i : indices) {
    at::Tensor& grad = s.params[i].mutable_grad();
    if (watched_only && (static_cast<size_t>(i) >= s.watched.size() || !grad.defined() ||
                         grad.unsafeGetTensorImpl() != s.watched[i].unsafeGetTensorImpl())) {
      continue;
    }
    lent_.emplace_back(i, grad);
    grad = s.slots[i];
  }
}

void GradientPath::ReturnSlots() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& [i, grad] : lent_) state_->params[i].mutable_grad() = std::move(grad);
  lent_.clear();
}

std::vector<int64_t> GradientPath::GiveSpares(const std::vector<at::Tensor>& spares) {
  std::lock_guard<std::mutex> lock(state_->mu);
  const State& s = *state_;
  std::vector<int64_t> misfits;
  if (s.closed) return misfits;  // nothing pending any more
  if (spares.size() != s.params.size()) throw std::invalid_argument("give_spares: one spare per parameter");
  for (size_t i = 0; i < s.params.size() && i < s.watched.size(); ++i) {
    if (!s.pending[i]) continue;
    const at::Tensor& p = s.params[i];
    at::Tensor& grad = p.mutable_grad();
    if (!grad.defined()) continue;
    const c10::TensorImpl* held = grad.unsafeGetTensorImpl();
    if (held != s.watched[i].unsafeGetTensorImpl() && held != s.slots[i].unsafeGetTensorImpl()) continue;
    const at::Tensor& spare = spares[i];
    // What the Python setter of p.grad would refuse, this refuses too.
    if (!spare.defined() || spare.scalar_type() != p.scalar_type() || spare.device() != p.device() ||
        !spare.sizes().equals(p.sizes()) || spare.layout() != p.layout()) {
      misfits.push_back(static_cast<int64_t>(i));
      continue;
    }
    grad = spare;
  }
  return misfits;
}

// Note [Graph reads]
// ~~~~~~~~~~~~~~~~~~
// A leaf's AccumulateGrad node is held by the graphs that read the leaf; the
// leaf itself keeps only a weak pointer to it, and its tensor hooks live on
// the leaf, not on the node. After a lazy step() we drop that weak pointer
// for every parameter whose update waits (ForgetGraphReads): the graphs
// still alive keep their node, and the first op that reads the parameter
// with autograd afterwards makes a new one. So, at the point where an update
// is applied, "this parameter has an accumulator" means exactly "a graph made
// since step() read it before its update": a stale read (FirstStale).
//
// Note [Unseen parameter writes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The read guard (Note [Guarded reads] in reads.py) applies a pending update
// before any torch operation of the training thread that touches the
// parameter, writes included, so that the write lands after the update as in
// synchronous training. Some writes never reach it: Tensor.set_() (torch
// binds it without the __torch_function__ check), an in-place op in code
// that torch.compile traced, or on another thread. Each moves the
// parameter's version counter, which ForgetGraphReads records: a version
// that moved before the update is applied means the update would land on
// the changed value, where synchronous training changes the updated one.
// FirstStale reports it and the apply raises, naming the parameter, before
// anything is applied. No other parameter's update moves the counter: a
// lazy step needs every parameter to have one of its own (Note [Shared
// version counters] in lazy.py). A write that moves no counter (a c10d
// collective handed the parameter; an alias from `.data`, whose counter is
// its own, written on another thread) stays the gap that docs/lazy-step.md
// states. A parameter without a counter (an inference tensor) is not
// checked.
void GradientPath::ForgetGraphReads(const std::vector<int64_t>& indices) {
  std::lock_guard<std::mutex> lock(state_->mu);
  State& s = *state_;
  for (int64_t i : indices) {
    CheckIndex(s.params.size(), i, "forget_graph_reads");
    const at::Tensor& p = s.params[i];
    if (torch::autograd::impl::get_autograd_meta(p) != nullptr) compat::DropGradAccumulator(p);
    if (torch::autograd::impl::version_counter(p).enabled()) s.param_versions[i] = p._version();
  }
}

std::pair<int64_t, bool> GradientPath::FirstStale(const std::vector<int64_t>& indices) {
  std::lock_guard<std::mutex> lock(state_->mu);
  const State& s = *state_;
  for (int64_t i : indices) CheckIndex(s.params.size(), i, "first_stale");
  // One walk, the answer of two: a graph read anywhere before a moved version anywhere (see the header), so the
  // first moved version is only remembered on the way.
  int64_t written = -1;
  for (int64_t i : indices) {
    const at::Tensor& p = s.params[i];
    if (torch::autograd::impl::get_autograd_meta(p) != nullptr &&
        torch::autograd::impl::try_get_grad_accumulator(p)) {
      return {i, false};
    }
    if (written < 0 && torch::autograd::impl::version_counter(p).enabled() && p._version() != s.param_versions[i]) {
      written = i;
    }
  }
  return {written, written >= 0};
}

}  // namespace dcredit
