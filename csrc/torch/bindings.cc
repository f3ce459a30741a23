// pybind11 module dcredit_opt._C: an Engine is a Scheduler plus its Backend.
//
// Every call that can block releases the GIL. Python never runs on our
// threads: completions land in the scheduler's tables, and Python reads them
// when it asks (wait_tensor, tensor_done).
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../core/backends.h"
#include "../core/final_gate.h"
#include "../core/scheduler.h"
#include "addresses.h"
#include "gradient_path.h"
#include "side_sums.h"
#include "torch_backend.h"
#include "torch_compat.h"

namespace dcredit {
namespace {

class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::chrono::milliseconds ToMs(double seconds) {
  if (!(seconds > 0)) throw std::invalid_argument("timeout_s must be positive, got " + std::to_string(seconds));
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5));
}

// Turns a scheduler failure into the Python exception that says what it is.
template <typename F>
void Rethrow(F&& f) {
  try {
    f();
  } catch (const SchedulerError& e) {
    if (e.status.code == StatusCode::kTimeout) throw TimeoutError(e.what());
    throw;
  }
}

// The optimizer's op for its blocks' collectives (an average is a sum, then scaled).
c10d::ReduceOp::RedOpType ReduceOpNamed(const std::string& name) {
  if (name == "sum") return c10d::ReduceOp::SUM;
  if (name == "min") return c10d::ReduceOp::MIN;
  if (name == "max") return c10d::ReduceOp::MAX;
  if (name == "product") return c10d::ReduceOp::PRODUCT;
  throw std::invalid_argument("reduce must be \"sum\", \"min\", \"max\" or \"product\", got \"" + name + "\"");
}

// Note [Global usage] (usage.py): one rank's tally, written in one pass into `out` (int32, on the CPU,
// contiguous): the flags `used` (uint8, one per tensor), then `tail` (int32: the rows proposal), then `rest`.
// Every iteration, after backward: one call instead of a list or a few array operations per part.
void FillTally(const at::Tensor& out, const pybind11::buffer& used, const pybind11::buffer& tail,
               const std::vector<int32_t>& rest) {
  pybind11::buffer_info flags = used.request();
  pybind11::buffer_info proposal = tail.request();
  if (flags.itemsize != 1 || flags.ndim != 1 || flags.strides[0] != 1) {
    throw std::invalid_argument("fill_tally: used must be contiguous bytes");
  }
  if (proposal.itemsize != 4 || proposal.ndim != 1 || proposal.strides[0] != 4) {
    throw std::invalid_argument("fill_tally: tail must be contiguous 32-bit integers");
  }
  const int64_t n = flags.shape[0] + proposal.shape[0] + static_cast<int64_t>(rest.size());
  if (out.scalar_type() != at::kInt || !out.device().is_cpu() || !out.is_contiguous() || out.dim() != 1 ||
      out.numel() != n) {
    throw std::invalid_argument("fill_tally: out must be a contiguous int32 CPU tensor of " + std::to_string(n) +
                                " values");
  }
  int32_t* to = out.data_ptr<int32_t>();
  const auto* from = static_cast<const uint8_t*>(flags.ptr);
  for (ssize_t i = 0; i < flags.shape[0]; ++i) *to++ = from[i];
  const auto* wanted = static_cast<const int32_t*>(proposal.ptr);
  for (ssize_t i = 0; i < proposal.shape[0]; ++i) *to++ = wanted[i];
  for (int32_t v : rest) *to++ = v;
}

// Note [Same weights] (usage.py): per tensor (on the CPU), the sum of its bytes read as words, as
// usage._word_sums computes it with torch operations, in one pass and without the dispatcher: where the values
// begin 8-byte aligned in their storage, 64-bit words summed modulo 2**64; else, 4-byte aligned, 32-bit words,
// sign-extended; then the bytes that fill no word, one by one. A tensor aligned to neither raises ValueError
// (the torch path raises for it as well).
at::Tensor WordSums(const std::vector<at::Tensor>& tensors) {
  at::Tensor out = at::empty({static_cast<int64_t>(tensors.size())}, at::TensorOptions().dtype(at::kLong));
  int64_t* to = out.data_ptr<int64_t>();
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& t = tensors[k];
    if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided) {
      throw std::invalid_argument("word_sums: tensor " + std::to_string(k) + " is not a dense CPU tensor");
    }
    // A strided tensor's values in order, as reshape(-1).contiguous() gives them (a copy only where needed).
    const at::Tensor flat = t.is_contiguous() ? t : t.reshape(-1).contiguous();
    const int64_t nbytes = flat.numel() * static_cast<int64_t>(flat.element_size());
    const int64_t offset = flat.storage_offset() * static_cast<int64_t>(flat.element_size());
    const auto* bytes = static_cast<const unsigned char*>(flat.data_ptr());
    uint64_t total = 0;
    int64_t whole = 0;
    if (offset % 8 == 0) {
      whole = nbytes / 8 * 8;
      for (int64_t i = 0; i < whole; i += 8) {
        uint64_t w;
        std::memcpy(&w, bytes + i, 8);
        total += w;
      }
    } else if (offset % 4 == 0) {
      whole = nbytes / 4 * 4;
      for (int64_t i = 0; i < whole; i += 4) {
        int32_t w;
        std::memcpy(&w, bytes + i, 4);
        total += static_cast<uint64_t>(static_cast<int64_t>(w));
      }
    } else {
      throw std::invalid_argument("word_sums: tensor " + std::to_string(k) + " begins at a byte offset of " +
                                  std::to_string(offset) + " in its storage, aligned to neither 8 nor 4");
    }
    for (int64_t i = whole; i < nbytes; ++i) total += bytes[i];
    std::memcpy(to + k, &total, 8);
  }
  return out;
}

// Note [Same updates] (usage.py): whether the summed tally `summed` shows, from `at` on, a rank that sent
// other values than `mine` (every rank's values, then their squares, summed over `world` ranks).
bool AgreementBroken(const at::Tensor& summed, int64_t at, const std::vector<int64_t>& mine, int64_t world) {
  const int64_t k = static_cast<int64_t>(mine.size());
  if (summed.scalar_type() != at::kInt || !summed.device().is_cpu() || !summed.is_contiguous() || summed.dim() != 1 ||
      at < 0 || summed.numel() < at + 2 * k) {
    throw std::invalid_argument("turn_tally: summed must be a contiguous int32 CPU tensor of at least " +
                                std::to_string(at + 2 * k) + " values");
  }
  const int32_t* got = summed.data_ptr<int32_t>() + at;
  for (int64_t j = 0; j < k; ++j) {
    if (got[j] != world * mine[j] || got[k + j] != world * mine[j] * mine[j]) return true;
  }
  return false;
}

// Note [Global usage] (usage.py): a steady iteration's tally in one call, where step() would otherwise make
// five. This rank's part into `out` (FillTally); the tally in flight (ticket `last`, none where negative)
// waited for; then, unless its sums (`summed`) break the agreement on `mine` (AgreementBroken: nothing is
// started, and every rank, seeing the same sums, raises alike), the sum of `out` started and the flags
// `used` cleared for the next iteration. Returns the new sum's ticket, or -1 where the agreement broke.
int64_t TurnTally(SideSums& sums, int64_t last, const at::Tensor& out, const pybind11::buffer& used,
                  const pybind11::buffer& tail, const std::vector<int32_t>& rest,
                  const std::optional<at::Tensor>& summed, int64_t at, const std::vector<int64_t>& mine,
                  int64_t world, double timeout_s) {
  const auto timeout = ToMs(timeout_s);
  pybind11::buffer_info flags = used.request(/*writable=*/true);
  FillTally(out, used, tail, rest);
  int64_t ticket = -1;
  {
    pybind11::gil_scoped_release nogil;
    Rethrow([&] {
      if (last >= 0) sums.Wait(last, timeout);
      if (summed.has_value() && AgreementBroken(*summed, at, mine, world)) return;
      ticket = sums.Start(out);
    });
  }
  if (ticket >= 0) std::memset(flags.ptr, 0, static_cast<size_t>(flags.shape[0]));
  return ticket;
}

class Engine {
 public:
  static std::unique_ptr<Engine> Torch(std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups, double timeout_s,
                                       const std::string& reduce) {
    auto backend = std::make_unique<TorchBackend>(std::move(groups), ReduceOpNamed(reduce));
    TorchBackend* torch = backend.get();
    auto engine = std::make_unique<Engine>(std::move(backend), timeout_s);
    engine->torch_ = torch;
    return engine;
  }
  static std::unique_ptr<Engine> Manual(double timeout_s) {
    auto backend = std::make_unique<ManualBackend>();
    ManualBackend* manual = backend.get();
    auto engine = std::make_unique<Engine>(std::move(backend), timeout_s);
    engine->manual_ = manual;
    return engine;
  }
  static std::unique_ptr<Engine> Noop(double timeout_s) {
    return std::make_unique<Engine>(std::make_unique<NoopBackend>(), timeout_s);
  }

  Engine(std::unique_ptr<Backend> backend, double timeout_s)
      : backend_(std::move(backend)), scheduler_(std::make_unique<Scheduler>(backend_.get(), ToMs(timeout_s))) {}

  ~Engine() { scheduler_->Shutdown(); }

  // Stops the scheduler (joins its dispatch thread), then lets go of the
  // process groups (TorchBackend::Close). Idempotent.
  void Shutdown() {
    scheduler_->Shutdown();
    if (torch_ != nullptr) torch_->Close();
  }

  void SetPlan(int32_t num_tensors, std::vector<int32_t> order, const std::vector<int32_t>& segments,
               const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
               const std::vector<int64_t>& bytes, const std::vector<int32_t>& priorities,
               const std::vector<std::vector<int32_t>>& block_tensors, std::vector<int32_t> phase1_windows,
               std::vector<int32_t> phase2_windows, int64_t credit_bytes, int32_t channels,
               const std::vector<at::Tensor>& buffers, double postscale,
               const std::vector<at::Tensor>& wire_buffers, const std::vector<int32_t>& block_ops,
               const std::vector<int32_t>& block_after, const std::vector<bool>& block_at_flush) {
    const size_t B = segments.size();
    if (offsets.size() != B || numels.size() != B || bytes.size() != B || priorities.size() != B ||
        block_tensors.size() != B) {
      throw std::invalid_argument("set_plan: per-block lists differ in length");
    }
    // Note [Two-stage blocks]: empty lists mean every block is one all-reduce.
    for (const size_t n : {block_ops.size(), block_after.size(), block_at_flush.size()}) {
      if (n != 0 && n != B) throw std::invalid_argument("set_plan: per-block stage lists differ in length");
    }
    PlanSpec plan;
    plan.num_tensors = num_tensors;
    plan.order = std::move(order);
    plan.blocks.resize(B);
    for (size_t b = 0; b < B; ++b) {
      plan.blocks[b] = BlockSpec{segments[b], offsets[b], numels[b], bytes[b], priorities[b], block_tensors[b]};
      if (!block_ops.empty()) plan.blocks[b].op = static_cast<BlockOp>(block_ops[b]);
      if (!block_after.empty()) plan.blocks[b].after = block_after[b];
      if (!block_at_flush.empty()) plan.blocks[b].at_flush = block_at_flush[b];
    }
    plan.phase1_windows = std::move(phase1_windows);
    plan.phase2_windows = std::move(phase2_windows);
    plan.credit_bytes = credit_bytes;
    plan.channels = channels;
    ValidatePlan(plan);
    if (torch_ != nullptr) {
      if (channels > torch_->num_channels()) {
        throw std::invalid_argument("plan wants " + std::to_string(channels) + " channels, the engine has " +
                                    std::to_string(torch_->num_channels()));
      }
      if (!scheduler_->Idle()) throw std::logic_error("set_plan while blocks are pending");
      torch_->SetBlocks(buffers, wire_buffers, plan.blocks, plan.num_tensors, postscale);
    }
    scheduler_->SetPlan(std::move(plan));
  }

  // The scheduler's calls, plus what a CUDA device needs around them
  // (Note [CUDA streams]): the event is recorded before the scheduler may
  // release, and so launch, the tensor's blocks.
  void StartIteration() {
    scheduler_->StartIteration();
    if (torch_ != nullptr) torch_->StartIteration();
  }
  void MarkReady(int32_t tensor, bool record_event) {
    if (record_event && torch_ != nullptr) torch_->RecordReady(tensor);
    scheduler_->MarkReady(tensor);
  }
  void Flush(bool record_event) {
    if (record_event && torch_ != nullptr) torch_->RecordRest();
    scheduler_->Flush();
  }

  // Note [Stream-ordered waits]: the current stream waits for `tensors`'
  // reduced blocks; the host only until they are enqueued. Where that does
  // not apply (CPU blocks, another backend, a failed block) the host waits
  // until they are done, as wait_tensors. True if the wait was stream-ordered.
  bool WaitTensorsOnStream(const std::vector<int32_t>& tensors, std::chrono::milliseconds timeout) {
    if (torch_ != nullptr && torch_->WaitFinalOnStream(tensors, timeout)) return true;
    for (int32_t t : tensors) scheduler_->WaitTensor(t, timeout);
    return false;
  }

  // Whether WaitTensorsOnStream({tensor}) would return without waiting.
  bool TensorFinal(int32_t tensor) {
    return (torch_ != nullptr && torch_->TensorFinal(tensor)) || scheduler_->TensorDone(tensor);
  }
  py::bytes Finals() {
    const int32_t n = scheduler_->num_tensors();
    std::string out(static_cast<size_t>(n), '\0');
    for (int32_t t = 0; t < n; ++t) out[t] = TensorFinal(t) ? 1 : 0;
    return py::bytes(out);
  }

  Scheduler& scheduler() { return *scheduler_; }
  ManualBackend& manual() {
    if (manual_ == nullptr) throw std::logic_error("not a manual engine");
    return *manual_;
  }

 private:
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Scheduler> scheduler_;
  TorchBackend* torch_ = nullptr;
  ManualBackend* manual_ = nullptr;
};

}  // namespace
}  // namespace dcredit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace dcredit;
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;

  // Python bases from dcredit_opt/errors.py, so that the engine's errors are DCreditErrors (one type for users
  // to catch) and keep their old built-in bases: CollectiveError is a RuntimeError, CollectiveTimeout also a
  // TimeoutError.
  py::module_ errors = py::module_::import("dcredit_opt.errors");
  py::register_exception<SchedulerError>(m, "SchedulerError", errors.attr("CollectiveError"));
  py::register_exception<TimeoutError>(m, "Timeout", errors.attr("CollectiveTimeout"));

  m.attr("RELEASE_ALL") = kReleaseAll;
  // Whether this build can reduce blocks on CUDA devices (see cuda_sync.h).
  m.attr("WITH_CUDA") = kWithCuda;

  // Note [Kept aliases] (optimizer/watched.py): an alias of a gradient slot gets memory of its own, holding
  // what it holds now, and a version counter of its own (a detach() alias shares the slot's), so that writes
  // through it reach neither the slot nor the slot's checks.
  m.def(
      "give_own_memory",
      [](at::Tensor alias) {
        at::Tensor copy = alias.clone();
        alias.set_data(copy);
        torch::autograd::impl::set_version_counter(alias, c10::VariableVersion(/*version=*/0));
      },
      py::arg("alias"), "The alias gets its own copy of what it holds, and its own version counter.");

  m.def("word_sums", &WordSums, py::arg("tensors"),
        "Per CPU tensor, the sum of its bytes read as words, modulo 2**64 (Note [Same weights] in usage.py).");
  m.def("fill_tally", &FillTally, py::arg("out"), py::arg("used"), py::arg("tail"), py::arg("rest"),
        "One rank's tally in one pass: the used flags, the rows proposal, then the rest (Note [Global usage]).");

  // Note [Guard cost] in reads.py: the read guard's address table (addresses.h).
  py::class_<AddressTable>(m, "AddressTable")
      .def(py::init<std::vector<std::tuple<uint64_t, uint64_t, int64_t>>, const py::buffer&>(), py::arg("ranges"),
           py::arg("pending"))
      .def("touched", &AddressTable::Touched, py::arg("args"), py::arg("kwargs"),
           "The tracked tensors the arguments touch, by memory, in order (an index once per touching tensor).")
      .def("pending_touched", &AddressTable::PendingTouched, py::arg("args"), py::arg("kwargs"),
           "Those of them whose update is pending, each once, in the order first touched.");

  // Note [Gradient path] in gradient_path.h. The per-tensor arrays are the optimizer's writable buffers
  // (kept alive with the path); `slow(i)` and `failed(i, message)` are its Python fallbacks.
  py::class_<GradientPath>(m, "GradientPath")
      .def(py::init([](Engine& engine, std::vector<at::Tensor> params, const py::buffer& counts,
                       const py::buffer& marked, const py::buffer& used, const py::buffer& pending,
                       const py::buffer& versions, py::object slow, py::object before, py::object failed,
                       py::object opener) {
             const size_t n = params.size();
             auto pointer = [n](const py::buffer& b, ssize_t itemsize, const char* name) {
               py::buffer_info info = b.request(/*writable=*/true);
               if (info.itemsize != itemsize || info.ndim != 1 || static_cast<size_t>(info.shape[0]) != n ||
                   info.strides[0] != itemsize) {
                 throw std::invalid_argument(std::string("GradientPath: ") + name + " must be " +
                                             std::to_string(n) + " contiguous items of " +
                                             std::to_string(itemsize) + " bytes");
               }
               return info.ptr;
             };
             Engine* e = &engine;
             return std::make_unique<GradientPath>(
                 std::move(params), [e](int32_t t) { e->MarkReady(t, /*record_event=*/true); },
                 static_cast<int32_t*>(pointer(counts, 4, "counts")),
                 static_cast<uint8_t*>(pointer(marked, 1, "marked")), static_cast<uint8_t*>(pointer(used, 1, "used")),
                 static_cast<uint8_t*>(pointer(pending, 1, "pending")),
                 static_cast<int64_t*>(pointer(versions, 8, "versions")), std::move(slow), std::move(before),
                 std::move(failed), std::move(opener));
           }),
           py::arg("engine"), py::arg("params"), py::arg("counts"), py::arg("marked"), py::arg("used"),
           py::arg("pending"), py::arg("versions"), py::arg("slow"), py::arg("before"), py::arg("failed"),
           py::arg("opener"), py::keep_alive<1, 2>(), py::keep_alive<1, 4>(), py::keep_alive<1, 5>(),
           py::keep_alive<1, 6>(), py::keep_alive<1, 7>(), py::keep_alive<1, 8>())
      .def("set_slots", &GradientPath::SetSlots, py::arg("slots"), py::arg("watched"))
      .def("set_open", &GradientPath::SetOpen, py::arg("open"))
      .def("set_flushed", &GradientPath::SetFlushed, py::arg("flushed"))
      .def("set_passes_per_step", &GradientPath::SetPassesPerStep, py::arg("passes"))
      .def("set_prescale", &GradientPath::SetPrescale, py::arg("prescale"))
      .def("install", &GradientPath::Install)
      .def("refresh", &GradientPath::Refresh, py::arg("indices"))
      .def("close", &GradientPath::Close)
      .def("take_slow_count", &GradientPath::TakeSlowCount,
           "Gradients that took the Python path since the last call.")
      .def("first_moved", &GradientPath::FirstMoved,
           "The first parameter whose dtype or device is no longer its slot's, or -1.")
      .def("first_written", &GradientPath::FirstWritten, py::arg("indices"),
           "The first of `indices` whose slot was written since its version was recorded, or -1.")
      .def("not_watched", &GradientPath::NotWatched, "The tensors whose p.grad is not their watched alias now.")
      .def("note_pass", &GradientPath::NotePass, py::arg("i"),
           "Tensor i's backward pass was counted in Python: its p.grad and version are recorded.")
      .def("first_written_since_pass", &GradientPath::FirstWrittenSincePass,
           "The first counted tensor whose p.grad was written or replaced since its last pass, or -1.")
      .def("addresses", &GradientPath::Addresses, "Every parameter's data address, in order.")
      .def("lend_slots", &GradientPath::LendSlots, py::arg("indices"), py::arg("watched_only") = false,
           "p.grad = its slot for each of `indices` (watched_only: where p.grad is its watched alias now); what "
           "it held is kept for return_slots().")
      .def("return_slots", &GradientPath::ReturnSlots, "p.grad back to what lend_slots() found.")
      .def("give_spares", &GradientPath::GiveSpares, py::arg("spares"),
           "p.grad = spares[i] where the update is pending and p.grad is the slot or its alias; the misfits.")
      .def("first_shared", &GradientPath::FirstShared,
           "(i, counter): the first parameter whose storage another tensor holds too (counter false: Note "
           "[Hidden writes]), else whose version counter another tensor shares (counter true), else (-1, False).")
      .def("forget_graph_reads", &GradientPath::ForgetGraphReads, py::arg("indices"),
           "Drop the parameters' links to their accumulators, record their versions (Note [Graph reads]).")
      .def("first_stale", &GradientPath::FirstStale, py::arg("indices"),
           "(i, written): the first of `indices` a live graph made since read (written false), else the first "
           "changed in place since its version was recorded (written true), else (-1, False).");

  // The state machine of Note [Stream-ordered waits], alone, for tests on any machine.
  py::class_<FinalGate>(m, "FinalGate")
      .def(py::init([](const std::vector<std::vector<int32_t>>& block_tensors, int32_t num_tensors) {
             auto gate = std::make_unique<FinalGate>();
             gate->Reset(block_tensors, num_tensors);
             return gate;
           }),
           py::arg("block_tensors"), py::arg("num_tensors"))
      .def("start_iteration", &FinalGate::StartIteration, release())
      .def("mark_final", &FinalGate::MarkFinal, py::arg("block"), release())
      .def("is_final", &FinalGate::IsFinal, py::arg("tensor"))
      .def("fail", &FinalGate::Fail, release())
      .def("close", &FinalGate::Close, release())
      .def(
          "wait_final",
          [](FinalGate& g, const std::vector<int32_t>& tensors, double timeout_s) -> std::optional<std::vector<int32_t>> {
            std::vector<int32_t> blocks;
            bool ok = false;
            Rethrow([&] { ok = g.WaitFinal(tensors, ToMs(timeout_s), &blocks); });
            if (!ok) return std::nullopt;
            return blocks;
          },
          py::arg("tensors"), py::arg("timeout_s"), release(),
          "The blocks to wait on once every block of `tensors` is final; None if a block failed or the gate closed.");

  // Note [Side sums] in side_sums.h: the side group's sums, started from C++ on the calling thread.
  py::class_<SideSums>(m, "SideSums")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>>(), py::arg("group"))
      .def("start", &SideSums::Start, py::arg("tensor"), release(),
           "Start an in-place sum of the CPU tensor over the group's ranks, now; its ticket.")
      .def(
          "wait", [](SideSums& s, int64_t ticket, double timeout_s) { Rethrow([&] { s.Wait(ticket, ToMs(timeout_s)); }); },
          py::arg("ticket"), py::arg("timeout_s"), release(), "Until sum `ticket` is done.")
      .def("turn_tally", &TurnTally, py::arg("last"), py::arg("out"), py::arg("used"), py::arg("tail"),
           py::arg("rest"), py::arg("summed"), py::arg("at"), py::arg("mine"), py::arg("world"), py::arg("timeout_s"),
           "Note [Global usage]: fill `out`, wait for sum `last`, and start the sum of `out` unless `summed` shows "
           "a rank that sent other values than `mine`; its ticket, or -1.")
      .def("close", &SideSums::Close, release());

  py::class_<Engine>(m, "Engine")
      .def_static("torch", &Engine::Torch, py::arg("groups"), py::arg("timeout_s"), py::arg("reduce") = "sum",
                  "An engine whose blocks are all-reduced on `groups` (one per channel), with `reduce`: "
                  "\"sum\", \"min\", \"max\" or \"product\".")
      .def_static("manual", &Engine::Manual, py::arg("timeout_s"),
                  "An engine whose launches wait until `complete()` is called (tests).")
      .def_static("noop", &Engine::Noop, py::arg("timeout_s"),
                  "An engine whose launches complete at once (timing the scheduler alone).")
      .def("set_plan", &Engine::SetPlan, py::arg("num_tensors"), py::arg("order"), py::arg("segments"),
           py::arg("offsets"), py::arg("numels"), py::arg("bytes"), py::arg("priorities"),
           py::arg("block_tensors"), py::arg("phase1_windows"), py::arg("phase2_windows"),
           py::arg("credit_bytes"), py::arg("channels"), py::arg("buffers"), py::arg("postscale"),
           py::arg("wire_buffers") = std::vector<at::Tensor>(), py::arg("block_ops") = std::vector<int32_t>(),
           py::arg("block_after") = std::vector<int32_t>(), py::arg("block_at_flush") = std::vector<bool>(),
           release())
      .def(
          "set_device_windows", [](Engine& e, bool on) { e.scheduler().SetDeviceWindows(on); }, py::arg("on"),
          release(),
          "Note [Device windows]: count the credit window on the device where the backend can (CUDA blocks); "
          "only between iterations.")
      .def("start_iteration", &Engine::StartIteration, release())
      .def("mark_ready", &Engine::MarkReady, py::arg("tensor"), py::arg("record_event") = true, release(),
           "Gradient of `tensor` is final. With `record_event` (the default) and blocks on a CUDA device, its "
           "blocks' collectives wait for what the calling thread's current stream has enqueued so far; "
           "elsewhere it changes nothing. See Note [CUDA streams].")
      .def("flush", &Engine::Flush, py::arg("record_event") = true, release(),
           "End of backward: every tensor counts as ready (those not marked wait, on a CUDA device, for the "
           "calling thread's current stream).")
      .def(
          "wait_tensor",
          [](Engine& e, int32_t t, double timeout_s) {
            Rethrow([&] { e.scheduler().WaitTensor(t, ToMs(timeout_s)); });
          },
          py::arg("tensor"), py::arg("timeout_s"), release())
      .def(
          "wait_tensors",
          [](Engine& e, const std::vector<int32_t>& tensors, double timeout_s) {
            const auto timeout = ToMs(timeout_s);
            Rethrow([&] {
              for (int32_t t : tensors) e.scheduler().WaitTensor(t, timeout);
            });
          },
          py::arg("tensors"), py::arg("timeout_s"), release(),
          "wait_tensor for each of `tensors` in turn, in one call (each wait bounded by `timeout_s`).")
      .def(
          "wait_tensors_on_stream",
          [](Engine& e, const std::vector<int32_t>& tensors, double timeout_s) {
            bool ordered = false;
            Rethrow([&] { ordered = e.WaitTensorsOnStream(tensors, ToMs(timeout_s)); });
            return ordered;
          },
          py::arg("tensors"), py::arg("timeout_s"), release(),
          "Note [Stream-ordered waits]: on a CUDA device the calling thread's current stream waits for the reduced "
          "blocks of `tensors` and the host only until they are enqueued (True); elsewhere as wait_tensors "
          "(False).")
      .def(
          "wait_all", [](Engine& e, double timeout_s) { Rethrow([&] { e.scheduler().WaitAll(ToMs(timeout_s)); }); },
          py::arg("timeout_s"), release())
      .def(
          "wait_released",
          [](Engine& e, double timeout_s) { Rethrow([&] { e.scheduler().WaitReleased(ToMs(timeout_s)); }); },
          py::arg("timeout_s"), release(),
          "Wait until every block released so far is done, the unreleased ones aside: see "
          "Note [Interrupted backward] in dcredit_opt/optimizer/core.py.")
      .def(
          "tensor_done", [](Engine& e, int32_t t) { return e.scheduler().TensorDone(t); }, py::arg("tensor"),
          release())
      .def("finals", &Engine::Finals, "Per tensor, whether tensor_final(t) holds now (bytes, 0 or 1).")
      .def("tensor_final", &Engine::TensorFinal, py::arg("tensor"),
           "Whether wait_tensors_on_stream([tensor]) would return without waiting: its blocks are done, or on a "
           "CUDA device their results are enqueued (Note [Stream-ordered waits]).")
      .def(
          "idle", [](Engine& e) { return e.scheduler().Idle(); }, release())
      .def(
          "shutdown", [](Engine& e) { e.Shutdown(); }, release())
      .def("error",
           [](Engine& e) -> py::object {
             Status s = e.scheduler().status();
             if (s.ok()) return py::none();
             return py::str(s.message);
           })
      .def("num_blocks", [](Engine& e) { return e.scheduler().num_blocks(); })
      .def("num_tensors", [](Engine& e) { return e.scheduler().num_tensors(); })
      .def(
          "trace",
          [](Engine& e) {
            std::vector<BlockTrace> tr = e.scheduler().Trace();
            py::list out;
            for (const BlockTrace& t : tr) {
              out.append(py::make_tuple(t.block, t.channel, t.window, t.group, t.seq, t.release_ns, t.launch_ns,
                                        t.end_ns));
            }
            return out;
          },
          "Per block: (block, channel, window, group, seq, release_ns, launch_ns, end_ns).")
      .def("ready_times", [](Engine& e) { return e.scheduler().ReadyTimes(); })
      .def("pending",
           [](Engine& e) {
             py::list out;
             for (const auto& l : e.manual().Pending()) out.append(py::make_tuple(l.block, l.channel));
             return out;
           })
      .def("history",
           [](Engine& e) {
             py::list out;
             for (const auto& l : e.manual().History()) out.append(py::make_tuple(l.block, l.channel));
             return out;
           })
      .def(
          "orders_on_device", [](Engine& e, bool on) { e.manual().SetOrdersOnDevice(on); }, py::arg("on"),
          "Tests of Note [Device windows]: a launch may wait \"on the device\" for any block launched before it.")
      .def("ordered_behind",
           [](Engine& e) {
             py::list out;
             for (const auto& l : e.manual().History()) out.append(py::cast(l.behind));
             return out;
           },
           "Per launch so far, the blocks it was ordered behind on the device (Note [Device windows]).")
      .def(
          "next_launch",
          [](Engine& e, double timeout_s) -> py::object {
            ManualBackend::Launched l{};
            bool got;
            {
              py::gil_scoped_release unlocked;
              got = e.manual().NextLaunch(ToMs(timeout_s), &l);
            }
            if (!got) return py::none();
            return py::make_tuple(l.block, l.channel);
          },
          py::arg("timeout_s"), "The next (block, channel) to start, or None on timeout or close.")
      .def(
          "close_launches", [](Engine& e) { e.manual().Close(); }, release())
      .def(
          "complete",
          [](Engine& e, int32_t block, bool ok, const std::string& message) {
            return e.manual().Complete(block, ok ? Status::Ok() : Status::Error(message));
          },
          py::arg("block"), py::arg("ok") = true, py::arg("message") = "", release());
}
