#include "addresses.h"

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace dcredit {

namespace py = pybind11;

AddressTable::AddressTable(std::vector<std::tuple<uint64_t, uint64_t, int64_t>> ranges, const py::buffer& pending)
    : pending_(pending) {
  py::buffer_info info = pending_.request();
  if (info.itemsize != 1 || info.ndim != 1) throw std::invalid_argument("AddressTable: pending must hold bytes");
  flags_ = static_cast<const uint8_t*>(info.ptr);
  nflags_ = info.shape[0];
  for (size_t k = 0; k < ranges.size(); ++k) {
    const auto& [start, end, index] = ranges[k];
    if (end <= start || (k && start < starts_.back()) || index < 0 || index >= nflags_) {
      throw std::invalid_argument("AddressTable: range " + std::to_string(k) +
                                  " is empty, out of order, or names no tensor");
    }
    starts_.push_back(start);
    ends_.push_back(end);
    index_.push_back(index);
    hi_ = std::max(hi_, end);
  }
  lo_ = starts_.empty() ? 0 : starts_.front();
}

void AddressTable::Touch(PyObject* obj, std::vector<int64_t>& hits) const {
  if (!THPVariable_Check(obj)) return;
  const at::Tensor& t = THPVariable_Unpack(obj);
  // Sparse, fake and functional tensors have no address of their own: not a parameter.
  if (!t.defined() || t.layout() != at::kStrided || !t.has_storage() || t.numel() == 0) return;
  uint64_t ptr;
  try {
    ptr = reinterpret_cast<uint64_t>(t.data_ptr());
  } catch (const c10::Error&) {
    return;
  }
  if (!ptr || ptr >= hi_) return;
  // Bytes from the first element to just past the last, strides included.
  uint64_t extent = 1;
  if (t.is_contiguous()) {
    extent = static_cast<uint64_t>(t.numel());
  } else {
    for (int64_t d = 0; d < t.dim(); ++d) extent += static_cast<uint64_t>((t.size(d) - 1) * t.stride(d));
  }
  const uint64_t end = ptr + extent * static_cast<uint64_t>(t.element_size());
  if (end <= lo_) return;
  const size_t n = starts_.size();
  size_t k = std::upper_bound(starts_.begin(), starts_.end(), ptr) - starts_.begin();
  k = k ? k - 1 : 0;
  for (; k < n && starts_[k] < end; ++k) {
    if (ends_[k] > ptr) hits.push_back(index_[k]);
  }
}

void AddressTable::Scan(py::handle value, std::vector<int64_t>& hits) const {
  PyObject* obj = value.ptr();
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    for (py::handle item : value) Touch(item.ptr(), hits);
  } else {
    Touch(obj, hits);
  }
}

std::vector<int64_t> AddressTable::Touched(py::handle args, py::handle kwargs) const {
  std::vector<int64_t> hits;
  if (starts_.empty()) return hits;
  for (py::handle a : args) Scan(a, hits);
  if (PyDict_Check(kwargs.ptr())) {
    for (auto item : py::reinterpret_borrow<py::dict>(kwargs)) Scan(item.second, hits);
  }
  return hits;
}

std::vector<int64_t> AddressTable::PendingTouched(py::handle args, py::handle kwargs) const {
  std::vector<int64_t> read;
  for (int64_t i : Touched(args, kwargs)) {
    if (flags_[i] && std::find(read.begin(), read.end(), i) == read.end()) read.push_back(i);
  }
  return read;
}

}  // namespace dcredit
