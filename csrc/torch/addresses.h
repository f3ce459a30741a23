// The read guard's question at every torch operation while updates wait (Note [Guarded reads] and Note
// [Guard cost] in dcredit_opt/optimizer/reads.py): which pending parameters do the operation's tensor
// arguments touch, by memory? The Python Addresses.read_by and the pending filter after it, in one call.
#pragma once

#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace dcredit {

class AddressTable {
 public:
  // `ranges`: each tracked parameter's memory as (start, end, index) in bytes, sorted by start, none empty;
  // `pending`: the optimizer's per-tensor flags (one byte per tensor, nonzero while its update waits), a
  // buffer the table keeps alive and reads at every call.
  AddressTable(std::vector<std::tuple<uint64_t, uint64_t, int64_t>> ranges, const pybind11::buffer& pending);

  // Every tracked parameter the tensors among `args` and the values of `kwargs` (a dict or None) touch, one
  // level into lists and tuples, in order, an index once per touching tensor (as Addresses.read_by).
  std::vector<int64_t> Touched(pybind11::handle args, pybind11::handle kwargs) const;
  // Those of them whose update is pending, each once, in the order first touched.
  std::vector<int64_t> PendingTouched(pybind11::handle args, pybind11::handle kwargs) const;

 private:
  void Scan(pybind11::handle value, std::vector<int64_t>& hits) const;  // a tensor, or a list or tuple of them
  void Touch(PyObject* obj, std::vector<int64_t>& hits) const;

  std::vector<uint64_t> starts_, ends_;
  std::vector<int64_t> index_;
  uint64_t lo_ = 0, hi_ = 0;  // the span of all tracked memory: most arguments lie outside it
  pybind11::buffer pending_;
  const uint8_t* flags_ = nullptr;
  int64_t nflags_ = 0;
};

}  // namespace dcredit
