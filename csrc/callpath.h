// What the C++ call paths share (csrc/callpath.cpp: the NVLink engine; csrc/callpath_internode.cpp: the
// internode engine): Python helpers, the driver's launch or the tests' recorder, a kept launch (Launch),
// and Core, a Buffer's comm stream and events with Buffer._enter / _leave. Each module includes it once.
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
  PyObject* get_device = nullptr;    // torch._C._cuda_getDevice
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

py::object attr(py::handle o, PyObject* name) {
  PyObject* r = PyObject_GetAttr(o.ptr(), name);
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

void set_attr(py::handle o, PyObject* name, py::handle value) {
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

[[noreturn]] void launch_failed(int rc) {
  const char* name = nullptr;
  if (cu_error_name) cu_error_name(rc, &name);
  std::string msg = std::string("cuLaunchKernel failed: ") + (name ? name : "?") + " (" + std::to_string(rc) + ")";
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

// One Buffer's comm stream and events: what Buffer._enter / _leave and the calls' common gates do.
struct Core {
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
  py::dict served;           // calls served here, per op

  // ``s``: the settings callpath.py's engine() passes; ``ops``: the names ``served`` counts.
  Core(py::dict s, std::initializer_list<PyObject*> ops) {
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
    for (PyObject* op : ops) served[py::handle(op)] = 0;
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
    py::object r = py::reinterpret_steal<py::object>(PyObject_CallOneArg(G.raw_stream, int_obj(dev).ptr()));
    if (!r) throw py::error_already_set();
    return static_cast<u64>(as_int(r));
  }

  bool capturing() const {
    if (test) return false;
    py::object r = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(G.capturing));
    if (!r) throw py::error_already_set();
    return truthy(r);
  }

  bool on_device() const {
    if (test) return true;
    py::object r = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(G.get_device));
    if (!r) throw py::error_already_set();
    return as_int(r) == dev;
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

  std::pair<py::object, void*> exit_event() {
    size_t n = pool.size();
    for (size_t k = 0; k < n; ++k) {
      size_t i = (pool_at + k) % n;
      if (Py_REFCNT(pool[i].first.ptr()) == 1) {
        pool_at = (i + 1) % n;
        return {pool[i].first, reinterpret_cast<void*>(pool[i].second)};
      }
    }
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
          comm_obj.attr("wait_event")(ev);
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


  // ---------------------------------------------------------------- shared checks
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
};

}  // namespace
