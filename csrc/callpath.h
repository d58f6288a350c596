// What the C++ call paths share (csrc/callpath.cpp: the NVLink engine; csrc/callpath_internode.cpp: the
// internode engine): Python helpers, the driver's launch or the tests' recorder, a kept launch (Launch),
// opt-in per-phase timing (Phases), outputs carved from one allocation (carve, Outputs), Core (a Buffer's
// comm stream and events with Buffer._enter / _leave, the replayed calls' common argument checks and
// counts) and the module's common entry points (setup_globals, def_common). Each module includes it once.
#pragma once

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using i64 = int64_t;
using u64 = uint64_t;
using Clock = std::chrono::steady_clock;
using Shape = std::vector<i64>;

// ------------------------------------------------------------------------------------------------
// Python objects the module uses (set once by _setup) and attribute names (interned at import)
// ------------------------------------------------------------------------------------------------

struct Globals {
  PyObject* loader = nullptr;        // commlib.cuda.loader's __dict__ (the kernel build a replay needs)
  PyObject* launch_error = nullptr;  // commlib.utils.errors.KernelLaunchError
  PyObject* overlap = nullptr;       // commlib.utils.event.EventOverlap
  PyObject* handle = nullptr;        // commlib.handle.DispatchHandle
  PyObject* config = nullptr;        // commlib.config.Config
  PyObject* event_base = nullptr;    // torch._C._CudaEventBase (None without CUDA)
  PyObject* raw_stream = nullptr;    // torch._C._cuda_getCurrentRawStream
  PyObject* capturing = nullptr;     // torch._C._cuda_isCurrentStreamCapturing
  int hc_bad_me = 1, hc_bad_rank = 2, hc_sent = 4, hc_recv = 12, hc_sig_rank = 20, hc_expert = 28;
  bool ready = false;
};
Globals G;

#define CALLPATH_NAMES(X)                                                                                     \
  X(backend) X(failed) X(_base) X(_ring_channels) X(_ce) X(counters) X(replayed) X(_host_seq) X(last_wait_ns) \
  X(_destroyed) X(buffer_id) X(_configs) X(num_sms) X(num_max_nvl_chunked_send_tokens)                        \
  X(num_max_nvl_chunked_recv_tokens) X(num_max_rdma_chunked_send_tokens) X(num_max_rdma_chunked_recv_tokens)   \
  X(extra) X(cpp_plans) X(event) X(extra_tensors) X(cuda_event) X(_layout_plans) X(local_rows)                \
  X(intranode_rows) X(num_tokens) X(__dict__) X(wait_event) X(send_counts) X(recv_counts) X(dispatch)        \
  X(combine) X(bf16) X(fp8) X(_variant_key) X(_recording) X(_fast_launch) X(_plain_mode) X(rank_prefix_matrix) \
  X(channel_prefix_matrix) X(recv_channel_prefix_matrix) X(recv_src_idx) X(is_token_in_rank) X(send_head)     \
  X(num_recv_tokens) X(_raise_bad_ids) X(count_wait_failed) X(layout) X(cached)

struct Names {
#define CALLPATH_DECLARE(n) PyObject* n = nullptr;
  CALLPATH_NAMES(CALLPATH_DECLARE)
#undef CALLPATH_DECLARE
};
Names* N = nullptr;

void intern_names() {
  N = new Names();
#define CALLPATH_INTERN(n)                          \
  N->n = PyUnicode_InternFromString(#n);            \
  if (!N->n) throw py::error_already_set();
  CALLPATH_NAMES(CALLPATH_INTERN)
#undef CALLPATH_INTERN
}

// The Python C-API work of the C++ calls (tests count it per call, tests/test_callpath_internode.py):
// attribute reads and writes, calls into Python, and (while _py_ops turned it on) object allocations.
struct PyOps {
  u64 get = 0, set = 0, call = 0, alloc = 0;
};
PyOps py_ops;

py::object attr(py::handle o, PyObject* name) {
  ++py_ops.get;
  PyObject* r = PyObject_GetAttr(o.ptr(), name);
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

void set_attr(py::handle o, PyObject* name, py::handle value) {
  ++py_ops.set;
  if (PyObject_SetAttr(o.ptr(), name, value.ptr()) < 0) throw py::error_already_set();
}

bool truthy(py::handle o) {
  int r = PyObject_IsTrue(o.ptr());
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

// An exact int (not a bool) that fits 64 bits, into *out.
bool exact_int(py::handle o, i64* out) {
  if (!PyLong_CheckExact(o.ptr())) return false;
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o.ptr(), &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  *out = v;
  return true;
}

i64 as_int(py::handle o) {
  long long v = PyLong_AsLongLong(o.ptr());
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

py::object int_obj(i64 v) { return py::reinterpret_steal<py::object>(PyLong_FromLongLong(v)); }

bool is_tensor(py::handle o) { return THPVariable_Check(o.ptr()); }
bool is_exact_tensor(py::handle o) { return Py_TYPE(o.ptr()) == reinterpret_cast<PyTypeObject*>(THPVariableClass); }
const at::Tensor& tensor(py::handle o) { return THPVariable_Unpack(o.ptr()); }
py::object wrap(at::Tensor t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t))); }
u64 address(const at::Tensor& t) { return reinterpret_cast<u64>(t.data_ptr()); }
bool same_shape(const at::Tensor& t, const Shape& s) { return t.sizes() == c10::IntArrayRef(s); }

// A contiguous ``shape`` tensor of ``dtype`` over ``block``'s storage from byte ``offset`` (a multiple
// of its item size): its own TensorImpl holding the storage, made without the dispatcher (view ops
// through it cost more host time than the allocation), not an autograd view, as at::empty's are not.
at::Tensor carve(const at::Tensor& block, i64 offset, c10::IntArrayRef shape, at::ScalarType dtype) {
  auto keys = c10::DispatchKeySet(block.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU);
  caffe2::TypeMeta meta = c10::scalarTypeToTypeMeta(dtype);
  const i64 size = static_cast<i64>(meta.itemsize());
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(block.storage()), keys, meta);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(shape);
  impl->set_storage_offset(offset / size);
  TORCH_CHECK(offset % size == 0 && offset + t.numel() * size <= static_cast<i64>(block.storage().nbytes()),
              "commlib callpath: an output carved past its allocation (a bug in csrc/callpath.h)");
  return t;
}

i64 align_up(i64 n, i64 to) { return (n + to - 1) / to * to; }

i64 nbytes(const Shape& shape, at::ScalarType dtype) {
  i64 n = static_cast<i64>(c10::elementSize(dtype));
  for (i64 d : shape) n *= d;
  return n;
}

// A handle's kept plans (a cached dispatch's, kind 0, or a combine's, 1), one per (kind, key): a plan
// made later for the same pair replaces the earlier.
template <class Plan>
struct PlanSetOf {
  std::vector<std::shared_ptr<Plan>> plans;
  void add(std::shared_ptr<Plan> p) {
    for (auto& q : plans)
      if (q->kind == p->kind && q->key == p->key) {
        q = std::move(p);
        return;
      }
    plans.push_back(std::move(p));
  }
  Plan* find(int kind, i64 key) const {
    for (auto& q : plans)
      if (q->kind == kind && q->key == key) return q.get();
    return nullptr;
  }
};

// A replayed call's outputs: one tensor, or two in one allocation (the second at the first 256-byte
// boundary past the first): one device operation instead of two.
struct Outputs {
  Shape shape, shape2;
  at::ScalarType dtype = at::kByte, dtype2 = at::kFloat;
  bool two = false;
  i64 offset2 = 0, bytes = 0;  // the second's byte offset; the one allocation's bytes

  Outputs() = default;
  Outputs(Shape s, at::ScalarType t, py::handle s2, at::ScalarType t2)
      : shape(std::move(s)), dtype(t), dtype2(t2), two(!s2.is_none()) {
    if (two) shape2 = s2.cast<Shape>();
    offset2 = two ? align_up(nbytes(shape, dtype), 256) : 0;
    bytes = two ? offset2 + nbytes(shape2, dtype2) : nbytes(shape, dtype);
  }
};

// A new instance of a plain Python class, its __init__ skipped: the caller sets every attribute it has.
py::object bare_instance(PyObject* cls) {
  PyObject* o = PyType_GenericNew(reinterpret_cast<PyTypeObject*>(cls), nullptr, nullptr);
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

// What EventOverlap(event, extra) makes (commlib/utils/event.py): ``extra`` a tuple or None.
py::object make_overlap(py::handle event, py::handle extra) {
  py::object o = bare_instance(G.overlap);
  set_attr(o, N->event, event);
  set_attr(o, N->extra_tensors, extra);
  return o;
}

// ------------------------------------------------------------------------------------------------
// The device: cuLaunchKernel from libcuda, or (tests) a recorder of every device operation
// ------------------------------------------------------------------------------------------------

using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                         void**);
using ErrorNameFn = int (*)(int, const char**);
LaunchFn cu_launch = nullptr;
ErrorNameFn cu_error_name = nullptr;

py::list* recorder = nullptr;  // tests: device operations are appended here instead of issued
int recorder_launch_rc = 0;    // tests: the result the recorded cuLaunchKernel returns

std::string load_driver() {
  if (cu_launch) return "";
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    return e ? e : "dlopen(libcuda.so.1) failed";
  }
  cu_error_name = reinterpret_cast<ErrorNameFn>(dlsym(lib, "cuGetErrorName"));
  cu_launch = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
  return cu_launch ? "" : "libcuda.so.1 has no cuLaunchKernel";
}

void record(py::tuple entry) {
  if (recorder) recorder->append(std::move(entry));
}

[[noreturn]] void launch_failed(int rc, const char* what = "cuLaunchKernel") {
  const char* name = nullptr;
  if (cu_error_name) cu_error_name(rc, &name);
  std::string msg = std::string(what) + " failed: " + (name ? name : "?") + " (" + std::to_string(rc) + ")";
  PyObject* exc = PyObject_CallFunction(G.launch_error, "si", msg.c_str(), rc);
  if (exc) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
    Py_DECREF(exc);
  }
  throw py::error_already_set();
}

inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// ------------------------------------------------------------------------------------------------
// Opt-in per-phase host timing (_phases: benchmarks.bench_host prints it): off, a mark is one branch
// ------------------------------------------------------------------------------------------------

struct PhaseTimes {
  const char* op;
  const char* name;
  std::vector<u64> ns;  // one per mark
};
bool phases_on = false;
std::vector<PhaseTimes> phase_times;

// The time since the previous mark (or the call's start) goes to phase ``name`` of ``op``; a name marked
// more than once in a call (a launch per chunk) sums, so each call is one sample per phase it marked.
struct Phases {
  static constexpr int kMax = 24;
  const char* op;
  Clock::time_point last;
  int n = 0;
  const char* names[kMax];
  u64 sums[kMax];
  explicit Phases(const char* op_) : op(op_) {
    if (phases_on) last = Clock::now();
  }
  Phases(const Phases&) = delete;
  Phases& operator=(const Phases&) = delete;
  void mark(const char* name) {
    if (!phases_on) return;
    auto now = Clock::now();
    u64 ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count();
    last = now;
    for (int i = 0; i < n; ++i)
      if (names[i] == name) {
        sums[i] += ns;
        return;
      }
    if (n == kMax) return;
    names[n] = name;
    sums[n++] = ns;
  }
  // A sample of ``ns`` for phase ``name`` that no mark measured (time outside the call).
  void extra(const char* name, u64 ns) {
    if (phases_on && n < kMax) {
      names[n] = name;
      sums[n++] = ns;
    }
  }
  ~Phases() {
    for (int i = 0; i < n; ++i) add(names[i], sums[i]);
  }

 private:
  void add(const char* name, u64 ns) const {
    for (auto& p : phase_times)
      if (p.op == op && p.name == name) {
        if (p.ns.size() < 100000) p.ns.push_back(ns);
        return;
      }
    phase_times.push_back({op, name, {ns}});
  }
};

// ------------------------------------------------------------------------------------------------
// Launch: one kept kernel launch, its packed argument block patched in place per call
// ------------------------------------------------------------------------------------------------

struct Launch {
  u64 fn;
  unsigned grid, block, smem;
  std::string codes;               // struct codes of the kernel's parameters (commlib.cuda.loader)
  std::vector<std::string> names;  // their names in csrc/*.cu
  std::vector<size_t> offsets;     // byte offset of each inside the block
  std::vector<u64> store;          // the block (8-byte aligned)
  std::vector<void*> params;       // cuLaunchKernel's kernelParams
  size_t nbytes;
  py::object variant;              // loader._variant_key when it was made
  bool plain;

  Launch(u64 fn_, unsigned grid_, unsigned block_, unsigned smem_, std::string codes_, std::vector<std::string> names_,
         std::vector<size_t> offsets_, py::bytes packed, py::object variant_, bool plain_)
      : fn(fn_), grid(grid_), block(block_), smem(smem_), codes(std::move(codes_)), names(std::move(names_)),
        offsets(std::move(offsets_)), variant(std::move(variant_)), plain(plain_) {
    std::string bytes = packed;
    nbytes = bytes.size();
    if (names.size() != codes.size() || offsets.size() != codes.size())
      throw std::invalid_argument("Launch: codes, names and offsets differ in length");
    store.assign(nbytes / 8 + 1, 0);
    std::memcpy(store.data(), bytes.data(), nbytes);
    char* base = reinterpret_cast<char*>(store.data());
    for (size_t i = 0; i < codes.size(); ++i) {
      if (offsets[i] + width(codes[i]) > nbytes) throw std::invalid_argument("Launch: argument past the block");
      params.push_back(base + offsets[i]);
    }
  }

  // A copy with its own argument block (a plan that patches some slots once for good).
  Launch(const Launch& o)
      : fn(o.fn), grid(o.grid), block(o.block), smem(o.smem), codes(o.codes), names(o.names), offsets(o.offsets),
        store(o.store), nbytes(o.nbytes), variant(o.variant), plain(o.plain) {
    char* base = reinterpret_cast<char*>(store.data());
    for (size_t off : offsets) params.push_back(base + off);
  }
  Launch& operator=(const Launch&) = delete;

  static size_t width(char code) { return (code == 'Q' || code == 'q' || code == 'd') ? 8 : 4; }

  // The position of parameter ``name``, whose struct code must be ``code`` ('Q': a pointer or u64, 'i': int).
  int slot(const std::string& name, char code) const {
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] != name) continue;
      if (codes[i] != code)
        throw std::invalid_argument("kernel parameter " + name + " has struct code " + codes[i] + ", expected " + code);
      return static_cast<int>(i);
    }
    throw std::invalid_argument("the kernel has no parameter " + name);
  }

  void set(int slot, u64 v) { std::memcpy(params[slot], &v, 8); }
  void set_i32(int slot, int32_t v) { std::memcpy(params[slot], &v, 4); }
  // An integer parameter of either width (a pointer, a row count), by its struct code.
  void set_value(int slot, i64 v) {
    if (slot < 0 || slot >= static_cast<int>(codes.size())) throw std::invalid_argument("Launch: no such parameter");
    if (width(codes[slot]) == 8)
      set(slot, static_cast<u64>(v));
    else
      set_i32(slot, static_cast<int32_t>(v));
  }
  u64 get(int slot) const {
    u64 v;
    std::memcpy(&v, params[slot], 8);
    return v;
  }

  // Still what commlib.cuda.loader.launch would run (loader.Replay.current): the same kernel build and
  // load / store mode, the driver's launch path on, no record_launches block open.
  bool current() const {
    PyObject* d = G.loader;
    if (PyDict_GetItem(d, N->_variant_key) != variant.ptr()) return false;
    if (PyDict_GetItem(d, N->_recording) != Py_None) return false;
    PyObject* fast = PyDict_GetItem(d, N->_fast_launch);
    if (!fast || PyObject_IsTrue(fast) != 1) return false;
    PyObject* pm = PyDict_GetItem(d, N->_plain_mode);
    return pm && (PyObject_IsTrue(pm) == 1) == plain;
  }

  void issue(u64 stream) {
    if (recorder) {
      record(py::make_tuple("launch", fn, stream, grid, block, smem, py::bytes(bytes())));
      if (recorder_launch_rc) launch_failed(recorder_launch_rc);
      return;
    }
    if (!cu_launch) throw std::runtime_error("callpath: no CUDA driver to launch with (tests: _record(True) first)");
    int rc = cu_launch(reinterpret_cast<void*>(fn), grid, 1, 1, block, 1, 1, smem, reinterpret_cast<void*>(stream),
                       params.data(), nullptr);
    if (rc) launch_failed(rc);
  }

  std::string bytes() const { return std::string(reinterpret_cast<const char*>(store.data()), nbytes); }
};

using LaunchP = std::shared_ptr<Launch>;

struct Stream {
  c10::Stream c;
  u64 raw;
};

// A replayed cached dispatch's or combine's arguments, as Core::dispatch_args / combine_args took them.
struct CachedArgs {
  py::handle data, second;   // x (a dispatch's data), and its scales or the combine's weights (or None)
  const at::Tensor* x = nullptr;
  py::object backend, cfg;   // the live backend, the resolved Config
  i64 key = 0;               // the plan's key: a dispatch's dtype, a combine's weight columns
  i64 T = -1;                // a combine's handle.num_tokens (read once)
};

// What Buffer._check_dispatch reads of a tensor argument (buffer.py _tensor_signature).
struct Sig {
  bool present = false;
  at::ScalarType dtype = at::kByte;
  Shape shape;
  bool contiguous = false;
  i64 device = -1;
};

Sig sig_of(py::handle o) {
  Sig s;
  if (o.is_none()) return s;
  const at::Tensor& t = tensor(o);
  s.present = true;
  s.dtype = t.scalar_type();
  s.shape = t.sizes().vec();
  s.contiguous = t.is_contiguous();
  s.device = t.get_device();
  return s;
}

// ``o`` has signature ``s`` (None for an absent one; else exactly a torch.Tensor). ``strides``: compare
// contiguity too (FP8 scales take any strides).
bool matches(const Sig& s, py::handle o, bool strides = true) {
  if (!s.present) return o.is_none();
  if (!is_exact_tensor(o)) return false;
  const at::Tensor& t = tensor(o);
  return t.scalar_type() == s.dtype && t.sizes() == c10::IntArrayRef(s.shape) &&
         (!strides || t.is_contiguous() == s.contiguous) && t.get_device() == s.device;
}

bool same_sig(const Sig& a, const Sig& b) {
  return a.present == b.present && a.dtype == b.dtype && a.shape == b.shape && a.contiguous == b.contiguous &&
         a.device == b.device;
}

// A DispatchHandle's fields that every non-cached dispatch sets anew (the rest: a kept call's template).
const char* const kHandleCallFields[] = {"rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                                         "recv_src_idx", "is_token_in_rank", "send_head", "num_recv_tokens", "extra"};

// A non-cached Buffer.dispatch's arguments (x split into data and scales by split_dispatch).
struct DispatchArgs {
  py::handle x, data, scales, ntpr, nrr, tir, ntpe, topk, w, alignment, worst, config;
  bool x_tuple;
};

// The tensor arguments of a non-cached dispatch that Buffer._leave keeps alive (async_finish) and records.
std::vector<py::handle> dispatch_inputs(const DispatchArgs& a) {
  std::vector<py::handle> inputs{a.data};
  for (py::handle o : {a.scales, a.topk, a.w, a.tir})
    if (!o.is_none()) inputs.push_back(o);
  return inputs;
}

// The arguments' parts, or false where they are not what a C++ path takes (topk_idx given, x a
// tensor or a (tensor, tensor) tuple, exact ints).
bool split_dispatch(DispatchArgs& a) {
  if (is_tensor(a.x)) {
    a.data = a.x;
    a.scales = py::none();
    a.x_tuple = false;
  } else {
    if (!PyTuple_CheckExact(a.x.ptr()) || PyTuple_GET_SIZE(a.x.ptr()) != 2) return false;
    a.data = PyTuple_GET_ITEM(a.x.ptr(), 0);
    a.scales = PyTuple_GET_ITEM(a.x.ptr(), 1);
    a.x_tuple = true;
    if (!is_exact_tensor(a.scales)) return false;
  }
  i64 v;
  return is_exact_tensor(a.data) && !a.topk.is_none() && exact_int(a.alignment, &v) && exact_int(a.worst, &v);
}

// The signature of a non-cached dispatch the Python path ran (what a later call must match to run in
// C++ from what that call kept): every argument's Sig, the ints, the Config (or the Buffer's num_sms).
struct FullKey {
  bool x_tuple = false;
  Sig x, scales, ntpr, nrr, tir, ntpe, topk, w;
  i64 alignment = 0, worst = 0;
  py::object config;  // the Config, or None (then num_sms: Buffer.num_sms)
  i64 cfg[5] = {0, 0, 0, 0, 0};
  i64 num_sms = -1;
  py::object handle_template;  // the handle's __dict__ with the per-call fields cleared (keep_entry)

  static bool config_fields(py::handle config, i64* out) {
    PyObject* fields[5] = {N->num_sms, N->num_max_nvl_chunked_send_tokens, N->num_max_nvl_chunked_recv_tokens,
                           N->num_max_rdma_chunked_send_tokens, N->num_max_rdma_chunked_recv_tokens};
    for (int i = 0; i < 5; ++i)
      if (!exact_int(attr(config, fields[i]), &out[i])) return false;
    return true;
  }

  // Takes the signature of ``a`` (split_dispatch'ed here); false where the call is not one a C++ path takes.
  bool capture(DispatchArgs& a, py::handle buffer_type) {
    if (!split_dispatch(a)) return false;
    for (py::handle o : {a.ntpr, a.tir, a.ntpe, a.topk})
      if (!is_exact_tensor(o) || !tensor(o).is_contiguous()) return false;
    for (py::handle o : {a.nrr, a.w})
      if (!o.is_none() && (!is_exact_tensor(o) || !tensor(o).is_contiguous())) return false;
    if (!a.config.is_none() && Py_TYPE(a.config.ptr()) != reinterpret_cast<PyTypeObject*>(G.config)) return false;
    if (!tensor(a.data).is_contiguous()) return false;
    x_tuple = a.x_tuple;
    x = sig_of(a.data);
    if (a.x_tuple) scales = sig_of(a.scales);
    ntpr = sig_of(a.ntpr);
    nrr = sig_of(a.nrr);
    tir = sig_of(a.tir);
    ntpe = sig_of(a.ntpe);
    topk = sig_of(a.topk);
    w = sig_of(a.w);
    exact_int(a.alignment, &alignment);
    exact_int(a.worst, &worst);
    config = py::reinterpret_borrow<py::object>(a.config);
    if (a.config.is_none()) return exact_int(attr(buffer_type, N->num_sms), &num_sms);
    return config_fields(a.config, cfg);
  }

  // A split call ``a`` has this signature.
  bool fits(const DispatchArgs& a, py::handle buffer_type) const {
    if (x_tuple != a.x_tuple || !matches(x, a.data)) return false;
    if (a.x_tuple && !matches(scales, a.scales, false)) return false;
    i64 al, wo;
    exact_int(a.alignment, &al);
    exact_int(a.worst, &wo);
    if (al != alignment || wo != worst) return false;
    if (!matches(ntpr, a.ntpr) || !matches(nrr, a.nrr) || !matches(tir, a.tir) || !matches(ntpe, a.ntpe) ||
        !matches(topk, a.topk) || !matches(w, a.w))
      return false;
    if (a.config.is_none()) {
      i64 n;
      return config.is_none() && exact_int(attr(buffer_type, N->num_sms), &n) && n == num_sms;
    }
    if (a.config.ptr() != config.ptr()) return false;
    i64 v[5];
    return config_fields(a.config, v) && std::equal(v, v + 5, cfg);
  }

  bool same(const FullKey& b) const {
    return x_tuple == b.x_tuple && same_sig(x, b.x) && same_sig(scales, b.scales) && same_sig(ntpr, b.ntpr) &&
           same_sig(nrr, b.nrr) && same_sig(tir, b.tir) && same_sig(ntpe, b.ntpe) && same_sig(topk, b.topk) &&
           same_sig(w, b.w) && alignment == b.alignment && worst == b.worst && config.ptr() == b.config.ptr() &&
           num_sms == b.num_sms && std::equal(cfg, cfg + 5, b.cfg);
  }
};

// Keeps ``e`` (a FullKey with its twin) among an engine's kept non-cached dispatches, with ``handle``'s
// fields as its template: in place of one with the same signature, else added (at most 16).
template <class Entry>
void keep_entry(std::vector<std::shared_ptr<Entry>>& full, std::shared_ptr<Entry> e, py::handle handle) {
  py::dict tpl = py::reinterpret_steal<py::dict>(PyDict_Copy(attr(handle, N->__dict__).ptr()));
  for (const char* f : kHandleCallFields) tpl[f] = py::none();
  e->handle_template = tpl;
  for (auto& old : full)
    if (old->same(*e)) {
      old = std::move(e);
      return;
    }
  if (full.size() >= 16) full.clear();
  full.push_back(std::move(e));
}

// One Buffer's comm stream and events: what Buffer._enter / _leave and the calls' common gates do.
struct Core {
  enum Op { kLayout, kCached, kCombine, kDispatch, kOps };

  bool test;                 // no device: operations go to the recorder, tensors live on the CPU
  i64 dev;                   // the Buffer's CUDA device index (-1 in tests)
  i64 rank, R;
  u64 timeout_ns;
  c10::Device device{c10::kCPU};
  Stream comm{c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)), 0};
  py::object comm_obj;       // the torch.cuda.Stream
  void* entry_event;         // Buffer._entry_event's cudaEvent_t (see Buffer._enter)
  py::object buffer_type;    // the Buffer class (its num_sms)
  py::object new_event;      // () -> (a torch.cuda.Event recorded once, its cudaEvent_t)
  const c10::impl::DeviceGuardImplInterface* impl = nullptr;
  std::vector<std::pair<py::object, u64>> pool;  // exit events; one only the pool holds is free again
  size_t pool_at = 0;
  u64 test_stream = 1;       // tests: the caller's (current) stream
  u64 alloc_stream = 0;      // tests: the stream allocations are made on (0: the current one)
  i64 served_n[kOps] = {0, 0, 0, 0};  // calls served here, per op (``served``)
  std::vector<Op> ops;                // the ops this engine serves

  // ``s``: the settings callpath.py's engine() passes; ``ops``: the ops ``served`` counts.
  Core(py::dict s, std::initializer_list<Op> ops_) : ops(ops_) {
    if (!G.ready) throw std::runtime_error("callpath: _setup was not called");
    test = s["test"].cast<bool>();
    dev = s["device_index"].cast<i64>();
    rank = s["rank"].cast<i64>();
    R = s["num_ranks"].cast<i64>();
    timeout_ns = s["timeout_ns"].cast<u64>();
    buffer_type = s["buffer_type"];
    new_event = s["new_event"];
    comm_obj = s["comm_stream"];
    entry_event = reinterpret_cast<void*>(s["entry_event"].cast<u64>());
    if (test) {
      comm.raw = s["comm_raw"].cast<u64>();
      return;
    }
    std::string missing = load_driver();
    if (!missing.empty()) throw std::runtime_error("callpath: no CUDA driver: " + missing);
    device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dev));
    impl = c10::impl::getDeviceGuardImpl(c10::kCUDA);
    comm.c = c10::Stream::unpack3(comm_obj.attr("stream_id").cast<i64>(), static_cast<c10::DeviceIndex>(dev),
                                  c10::kCUDA);
    comm.raw = comm_obj.attr("cuda_stream").cast<u64>();
  }

  // ---------------------------------------------------------------- streams and events
  Stream current() const {
    if (test) return Stream{c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)), test_stream};
    return Stream{impl->getStream(device), 0};
  }

  u64 current_raw() const {
    if (test) return test_stream;
    ++py_ops.call;
    py::object r = py::reinterpret_steal<py::object>(PyObject_CallOneArg(G.raw_stream, int_obj(dev).ptr()));
    if (!r) throw py::error_already_set();
    return static_cast<u64>(as_int(r));
  }

  bool capturing() const {
    if (test) return false;
    ++py_ops.call;
    py::object r = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(G.capturing));
    if (!r) throw py::error_already_set();
    return truthy(r);
  }

  bool on_device() const {
    if (test) return true;
    return impl->getDevice().index() == dev;   // what torch.cuda.current_device() reads, with no Python call
  }

  void event_record(void* ev, const Stream& s) {
    if (test) return record(py::make_tuple("record", reinterpret_cast<u64>(ev), s.raw));
    void* e = ev;
    impl->record(&e, s.c, static_cast<c10::DeviceIndex>(dev), c10::EventFlag::PYTORCH_DEFAULT);
  }

  void event_wait(void* ev, const Stream& s) {
    if (test) return record(py::make_tuple("wait", reinterpret_cast<u64>(ev), s.raw));
    impl->block(ev, s.c);
  }

  void record_stream(const at::Tensor& t, const Stream& s) {
    if (test) return record(py::make_tuple("record_stream", address(t), s.raw));
    impl->recordDataPtrOnStream(t.storage().data_ptr(), s.c);
  }

  bool query(const Stream& s) const {
    if (test) return true;
    return impl->queryStream(s.c);
  }

  // Allocations on ``s`` until the guard ends (the comm stream's outputs; the caller's stream is current).
  struct AllocOn {
    Core& e;
    bool on;
    c10::Stream prev{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
    u64 prev_raw = 0;
    AllocOn(Core& e_, const Stream& s, bool on_) : e(e_), on(on_) {
      if (!on) return;
      if (e.test) {
        prev_raw = e.alloc_stream;
        e.alloc_stream = s.raw;
      } else {
        prev = e.impl->exchangeStream(s.c);
      }
    }
    ~AllocOn() {
      if (!on) return;
      if (e.test)
        e.alloc_stream = prev_raw;
      else
        e.impl->exchangeStream(prev);
    }
  };

  at::Tensor empty(const Shape& shape, at::ScalarType dtype) {
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
    if (test)
      record(py::make_tuple("alloc", py::cast(shape), py::cast(dtype), alloc_stream ? alloc_stream : test_stream));
    return t;
  }

  // ``o``'s tensors (the second undefined where there is one only); the allocation goes to ``blocks``.
  std::pair<at::Tensor, at::Tensor> outputs(const Outputs& o, std::vector<at::Tensor>& blocks) {
    if (!o.two) return {blocks.emplace_back(empty(o.shape, o.dtype)), at::Tensor()};
    const at::Tensor& b = blocks.emplace_back(empty({o.bytes}, at::kByte));
    return {carve(b, 0, o.shape, o.dtype), carve(b, o.offset2, o.shape2, o.dtype2)};
  }

  std::pair<py::object, void*> exit_event() {
    size_t n = pool.size();
    for (size_t k = 0; k < n; ++k) {
      size_t i = (pool_at + k) % n;
      if (Py_REFCNT(pool[i].first.ptr()) == 1) {
        pool_at = (i + 1) % n;
        return {pool[i].first, reinterpret_cast<void*>(pool[i].second)};
      }
    }
    ++py_ops.call;
    py::tuple made = new_event();
    py::object ev = made[0];
    u64 raw = made[1].cast<u64>();
    if (pool.size() < 64) pool.emplace_back(ev, raw);
    return {ev, reinterpret_cast<void*>(raw)};
  }

  // Buffer._enter: the comm stream waits for previous_event, or for the caller's stream. Returns
  // whether the outputs belong to the caller's stream.
  bool enter(const Stream& compute, py::handle prev, bool alloc_on_comm) {
    if (!prev.is_none()) {
      py::object ev = attr(prev, N->event);
      if (!ev.is_none()) {
        if (!test && G.event_base != Py_None &&
            PyObject_TypeCheck(ev.ptr(), reinterpret_cast<PyTypeObject*>(G.event_base))) {
          u64 raw = static_cast<u64>(as_int(attr(ev, N->cuda_event)));
          if (raw) event_wait(reinterpret_cast<void*>(raw), comm);  // an event never recorded: nothing to wait for
        } else {
          ++py_ops.call;
          comm_obj.attr(N->wait_event)(ev);
        }
        return false;
      }
    }
    event_record(entry_event, compute);
    event_wait(entry_event, comm);
    return !alloc_on_comm;
  }

  // Buffer._leave: the allocator learns which streams use what; the exit event, waited for by the
  // caller's stream unless async_finish. ``inputs``: the call's tensor arguments (Python objects).
  py::object leave(const Stream& compute, const std::vector<at::Tensor>& blocks, const std::vector<py::handle>& inputs,
                   bool async_finish, bool on_compute) {
    if (async_finish)
      for (py::handle o : inputs) {
        const at::Tensor& t = tensor(o);
        if (t.is_cuda()) record_stream(t, comm);
      }
    if (on_compute) {
      if (async_finish)
        for (const at::Tensor& b : blocks) record_stream(b, comm);
    } else {
      for (const at::Tensor& b : blocks) record_stream(b, compute);
    }
    auto [ev, raw] = exit_event();
    event_record(raw, comm);
    if (!async_finish) event_wait(raw, compute);
    py::object extra = py::none();
    if (async_finish && !inputs.empty()) {
      py::tuple kept(inputs.size());
      for (size_t i = 0; i < inputs.size(); ++i) kept[i] = py::reinterpret_borrow<py::object>(inputs[i]);
      extra = std::move(kept);
    }
    return make_overlap(ev, extra);
  }


  // ---------------------------------------------------------------- shared checks and counts
  virtual ~Core() = default;

  // The backend of ``buffer`` if this engine may serve a call (each engine's own conditions), or null.
  virtual py::object live_backend(py::handle buffer) = 0;

  py::dict served() const {
    PyObject* names[kOps] = {N->layout, N->cached, N->combine, N->dispatch};
    py::dict d;
    for (Op op : ops) d[py::handle(names[op])] = served_n[op];
    return d;
  }

  // The backend's counter ``key`` grows by ``add``.
  static void add_count(py::handle counters, PyObject* key, i64 add) {
    PyObject* cur = PyDict_GetItem(counters.ptr(), key);
    if (!cur) throw py::key_error("counters");
    if (PyDict_SetItem(counters.ptr(), key, int_obj(as_int(cur) + add).ptr()) < 0) throw py::error_already_set();
  }

  // Buffer._resolve_config where it needs no Python: the Config given (when runnable), or the one a
  // call of this shape found before. Null: the Python path resolves it (and raises what it raises).
  py::object resolve_config(py::handle buffer, py::handle config, PyObject* kind, i64 T, i64 H, PyObject* dtype) {
    if (config.is_none()) {
      py::object key = py::make_tuple(py::handle(kind), T, H, py::handle(dtype), attr(buffer_type, N->num_sms));
      PyObject* hit = PyDict_GetItem(attr(buffer, N->_configs).ptr(), key.ptr());
      return hit ? py::reinterpret_borrow<py::object>(hit) : py::object();
    }
    if (!PyObject_TypeCheck(config.ptr(), reinterpret_cast<PyTypeObject*>(G.config))) return py::object();
    i64 n;
    if (!exact_int(attr(config, N->num_sms), &n) || n <= 0 || n % 2) return py::object();
    return py::reinterpret_borrow<py::object>(config);
  }

  static bool config_type_ok(py::handle config) {
    return config.is_none() || PyObject_TypeCheck(config.ptr(), reinterpret_cast<PyTypeObject*>(G.config));
  }

  // The calls' common gate (Buffer._replay): previous_event an EventOverlap or None, allocate_on_comm_stream
  // with its conditions, the Buffer's device current, no stream capture (captures take the full path).
  bool stream_args_ok(py::handle prev, bool async_finish, bool alloc_on_comm) {
    if (!prev.is_none() && !PyObject_TypeCheck(prev.ptr(), reinterpret_cast<PyTypeObject*>(G.overlap))) return false;
    if (alloc_on_comm && (prev.is_none() || !async_finish)) return false;
    return on_device() && !capturing();
  }

  // Buffer.dispatch(x, handle=handle, expert_alignment, config)'s checks before the plan's: null where
  // the Python path takes the call. Fills ``a`` (the key: x's dtype).
  bool dispatch_args(py::handle buffer, py::handle x, py::handle handle, py::handle alignment, py::handle config,
                     CachedArgs& a) {
    i64 al;
    if (!exact_int(alignment, &al) || al <= 0) return false;
    if (Py_TYPE(handle.ptr()) != reinterpret_cast<PyTypeObject*>(G.handle)) return false;
    a.data = x;
    a.second = py::none();
    if (!is_tensor(x)) {
      if (!PyTuple_CheckExact(x.ptr()) || PyTuple_GET_SIZE(x.ptr()) != 2) return false;
      a.data = PyTuple_GET_ITEM(x.ptr(), 0);
      a.second = PyTuple_GET_ITEM(x.ptr(), 1);
      if (!is_tensor(a.data)) return false;
    }
    a.x = &tensor(a.data);
    const at::Tensor& d = *a.x;
    if (d.dim() != 2 || !config_type_ok(config)) return false;
    a.backend = live_backend(buffer);
    if (!a.backend || !attr(handle, N->buffer_id).equal(attr(buffer, N->buffer_id))) return false;
    a.cfg = resolve_config(buffer, config, N->dispatch, d.size(0), d.size(1), a.second.is_none() ? N->bf16 : N->fp8);
    a.key = static_cast<i64>(d.scalar_type());
    return static_cast<bool>(a.cfg);
  }

  // Buffer.combine(x, handle, topk_weights, config)'s checks before the plan's, as dispatch_args (the
  // key: the weights' columns, 0 without).
  bool combine_args(py::handle buffer, py::handle x, py::handle handle, py::handle weights, py::handle config,
                    CachedArgs& a) {
    if (Py_TYPE(handle.ptr()) != reinterpret_cast<PyTypeObject*>(G.handle) || !is_tensor(x)) return false;
    a.data = x;
    a.second = weights;
    a.x = &tensor(x);
    if (a.x->dim() != 2 || !config_type_ok(config)) return false;
    a.key = 0;
    if (!weights.is_none()) {
      if (!is_tensor(weights) || tensor(weights).dim() != 2) return false;
      a.key = tensor(weights).size(1);
    }
    a.backend = live_backend(buffer);
    if (!a.backend || !attr(handle, N->buffer_id).equal(attr(buffer, N->buffer_id))) return false;
    if (!exact_int(attr(handle, N->num_tokens), &a.T)) return false;
    a.cfg = resolve_config(buffer, config, N->combine, a.T, a.x->size(1), N->bf16);
    return static_cast<bool>(a.cfg);
  }

  // The 6-tuple Buffer.dispatch returns for a cached dispatch run as ``out`` (run_cached's triple).
  static py::object dispatch_result(const py::tuple& out, const CachedArgs& a, py::handle handle) {
    py::object recv = a.second.is_none() ? py::object(out[0]) : py::object(py::make_tuple(out[0], out[1]));
    return py::make_tuple(recv, py::none(), py::none(), py::none(), handle, out[2]);
  }
};

// ------------------------------------------------------------------------------------------------
// The modules' common entry points
// ------------------------------------------------------------------------------------------------

// _setup: the Python objects every module uses (callpath.py import_built passes them).
void setup_globals(py::dict s) {
  auto keep = [](py::handle o) {
    Py_INCREF(o.ptr());
    return o.ptr();
  };
  G.loader = keep(s["loader"]);
  G.launch_error = keep(s["launch_error"]);
  G.overlap = keep(s["overlap"]);
  G.handle = keep(s["handle"]);
  G.config = keep(s["config"]);
  G.event_base = keep(s["event_base"]);
  G.raw_stream = keep(s["raw_stream"]);
  G.capturing = keep(s["capturing"]);
  G.ready = true;
}

// _py_ops's object-allocation count: the object allocator wrapped while it is on.
PyMemAllocatorEx counted_from{};
bool allocs_counted = false;
void* counted_malloc(void* ctx, size_t n) {
  ++py_ops.alloc;
  return counted_from.malloc(counted_from.ctx, n);
}
void* counted_calloc(void* ctx, size_t k, size_t n) {
  ++py_ops.alloc;
  return counted_from.calloc(counted_from.ctx, k, n);
}
void* counted_realloc(void* ctx, void* p, size_t n) { return counted_from.realloc(counted_from.ctx, p, n); }
void counted_free(void* ctx, void* p) { counted_from.free(counted_from.ctx, p); }

void count_allocs(bool on) {
  if (on == allocs_counted) return;
  if (on) {
    PyMem_GetAllocator(PYMEM_DOMAIN_OBJ, &counted_from);
    PyMemAllocatorEx mine{nullptr, counted_malloc, counted_calloc, counted_realloc, counted_free};
    PyMem_SetAllocator(PYMEM_DOMAIN_OBJ, &mine);
  } else {
    PyMem_SetAllocator(PYMEM_DOMAIN_OBJ, &counted_from);
  }
  allocs_counted = on;
}

// The tests' recorder (_record, _recorded, _py_ops), per-phase timing (_phases) and Launch, in module ``m``.
void def_common(py::module_& m) {
  m.def("_record", [](bool on, int launch_rc) {
    if (on && !recorder) recorder = new py::list();
    if (!on && recorder) {
      delete recorder;
      recorder = nullptr;
    }
    recorder_launch_rc = launch_rc;
  }, py::arg("on"), py::arg("launch_rc") = 0, "tests: record device operations instead of issuing them");
  m.def("_recorded", []() {
    py::list out = recorder ? *recorder : py::list();
    if (recorder) *recorder = py::list();
    return out;
  });
  m.def("_py_ops", [](bool count_allocations) {
    PyOps now = py_ops;   // read before the dict below allocates
    py::dict out;
    out["get"] = now.get;
    out["set"] = now.set;
    out["call"] = now.call;
    out["alloc"] = now.alloc;
    count_allocs(count_allocations);
    py_ops = PyOps();
    return out;
  }, py::arg("count_allocations") = false,
     "tests: the Python C-API work since the last call ({get, set, call, alloc}); counts object allocations "
     "from now while count_allocations");
  m.def("_phases", [](bool on) {
    py::dict out;
    for (auto& p : phase_times) {
      py::str key(std::string(p.op) + "." + p.name);
      py::list ns = out.contains(key) ? py::list(out[key]) : py::list();
      for (u64 v : p.ns) ns.append(v);
      out[key] = ns;
    }
    phase_times.clear();
    phases_on = on;
    return out;
  }, py::arg("on"), "per-phase host timing on or off; returns {op.phase: [ns per mark]} since the last call");
  py::class_<Launch, LaunchP>(m, "Launch", py::module_local())
      .def(py::init<u64, unsigned, unsigned, unsigned, std::string, std::vector<std::string>, std::vector<size_t>,
                    py::bytes, py::object, bool>(),
           py::arg("fn"), py::arg("grid"), py::arg("block"), py::arg("shared_mem"), py::arg("codes"),
           py::arg("names"), py::arg("offsets"), py::arg("packed"), py::arg("variant"), py::arg("plain"))
      .def("packed", [](const Launch& l) { return py::bytes(l.bytes()); })
      .def("slot", &Launch::slot)
      .def("current", &Launch::current);
}

// Entry points: torch's errors become the Python exceptions torch raises (AcceleratorError with its code).
#define CALLPATH_ENTRY(...) \
  HANDLE_TH_ERRORS          \
  __VA_ARGS__               \
  END_HANDLE_TH_ERRORS_PYBIND

}  // namespace
